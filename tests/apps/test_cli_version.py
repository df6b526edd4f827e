"""`torsh --version` answers without importing torch (or anything heavy): it used to take seconds."""

from __future__ import annotations

import subprocess
import sys

from torsh_kernels.version import __version__

_PROBE = """
import sys
sys.argv = ["torsh", "--version"]  # what the console script sees
from torsh_kernels.apps.cli import main
rc = main(["--version"])
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "numba", "triton", "numpy", "rich"))
print(rc, heavy)
"""


def test_version_imports_no_torch():
    p = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [f"torsh-kernels {__version__}", "0 []"]


def test_plain_import_registers_the_custom_ops_whatever_came_first():
    """``import torsh_kernels`` before torch still registers ``torch.ops.torsh.*`` (a library imported for its
    registrations); only the ``torsh --version`` process defers the ops, and a name used there loads them."""
    probe = "import torsh_kernels; import torch; print(hasattr(torch.ops.torsh, 'flatten'))"
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["True"]
    probe = (
        "import sys; sys.argv = ['torsh', '--version']; import torsh_kernels as tk; a = 'torch' in sys.modules; "
        "tk.flatten; import torch; print(a, hasattr(torch.ops.torsh, 'flatten'))"
    )
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["False", "True"]


def test_import_after_torch_registers_the_custom_ops_at_once():
    probe = "import torch, torsh_kernels; print(hasattr(torch.ops.torsh, 'flatten'))"
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["True"]


def test_the_submodules_a_plain_import_loaded_are_still_attributes():
    probe = "import torsh_kernels as tk; print(tk.ops.registry.PROVIDERS[-1], tk.env.fmt_bytes(2048))"
    p = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["torch", "2", "KiB"]
