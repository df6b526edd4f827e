"""Runs one chain of ```python blocks of a Markdown file, in order, in one namespace: a block alone, or a block
after the blocks it continues (``<!-- continues: NAME -->``); the child process of tests/test_docs.py, one per
chain, so no name leaks from one chain to another (``TORSH_SNIPPETS=BLOCKS.json python tests/docs_runner.py``;
the test writes the JSON).

Each block is compiled with the Markdown file as its file name and its lines where they are in that
file, so a traceback points into the document and shows its lines. The blocks run in this script's
``__main__`` namespace, so what they define is importable by name, as in a script: ``run_local``'s
spawned ranks unpickle ``__main__.fn``. A spawned process imports this file again as ``__mp_main__``
and runs the block that started it (``TORSH_SNIPPET_BLOCK``), alone, with ``__name__`` not ``"__main__"``,
as it would re-import that block saved as a script: a block that spawns processes must stand on its own.

Before each block the runner writes ``SNIPPET-START <file>:<line>`` to stderr, after it ``SNIPPET-DONE
<file>:<line> <seconds> s``, or after a failure ``SNIPPET-FAILED <file>:<line>`` and the traceback; it exits 1 at
the first failure of a chain. Where test_docs.py gives it several chains (blocks that touch no process group
and spawn nothing), each runs in a fresh namespace of its own (``__name__ == "__main__"``), in its own working
directory and with the environment as it was at the start, and a failed chain does not stop the next.
"""

import json as _json
import os as _os
import sys as _sys
import time as _time
import traceback as _traceback
import types as _types


def _chains() -> list:
    with open(_os.environ["TORSH_SNIPPETS"], encoding="utf-8") as f:
        return _json.load(f)


def _code(block: dict):
    # line numbers as in the document: pad with the lines before the block
    return compile("\n" * (block["line"] - 1) + block["code"], block["path"], "exec")


def _run(chain: list, namespace: dict) -> bool:
    for i, b in enumerate(chain):
        where = f"{b['name']}:{b['line']}"
        _os.environ["TORSH_SNIPPET_BLOCK"] = str(i)
        print(f"SNIPPET-START {where}", file=_sys.stderr, flush=True)
        t0 = _time.perf_counter()
        try:
            exec(_code(b), namespace)
            print(f"SNIPPET-DONE {where} {_time.perf_counter() - t0:.2f} s", file=_sys.stderr, flush=True)
        except BaseException as e:
            _sys.stdout.flush()
            tb = "".join(_traceback.format_exception(type(e), e, e.__traceback__.tb_next))  # from the block on
            print(f"SNIPPET-FAILED {where}\n{tb}", file=_sys.stderr, flush=True)
            return False
    return True


def _main() -> int:
    chains = _chains()
    if len(chains) == 1:  # this module's own namespace: what it defines is __main__'s, as in a script
        return 0 if _run(chains[0], globals()) else 1
    # several chains that touch no process group and spawn nothing: each in a namespace, a working directory
    # and an environment of its own, as if alone (tests/test_docs.py decides which may share a process)
    ok, home, environ = True, _os.getcwd(), dict(_os.environ)
    for k, chain in enumerate(chains):
        _os.chdir(home)
        _os.makedirs(str(k))
        _os.chdir(str(k))
        _os.environ.clear()
        _os.environ.update(environ)
        main = _types.ModuleType("__main__")  # a module of its own as __main__: what the chain defines pickles
        main.__builtins__ = __builtins__
        saved, _sys.modules["__main__"] = _sys.modules["__main__"], main
        try:
            ok = _run(chain, main.__dict__) and ok
        finally:
            _sys.modules["__main__"] = saved
    return 0 if ok else 1


def _replay() -> None:
    """In a spawned process: the block that spawned it (its functions then exist here), alone."""
    (chain,) = _chains()
    exec(_code(chain[int(_os.environ["TORSH_SNIPPET_BLOCK"])]), globals())


# the blocks see this directory on sys.path no more than a script in the temporary directory would
_here = _os.path.dirname(_os.path.abspath(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.abspath(p or ".") != _here]

if __name__ == "__main__":
    _sys.exit(_main())
elif __name__ == "__mp_main__" and "TORSH_SNIPPET_BLOCK" in _os.environ:
    _replay()
