"""torsh top: tailing rank files (partial lines, rotation), scraping a real Prometheus endpoint, --once --json, the
alerts it prints, typed errors, and the live view driven in tmux."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from torsh_kernels.apps.cli import main
from torsh_kernels.profiling.alerts import AlertSpec, JobAlerts, RankAlerts
from torsh_kernels.profiling.live import LiveSpec, Publisher
from torsh_kernels.profiling.top import DirSource, SourceError, TopState, UrlSource, parse_prometheus, sparkline


def _rec(rank=0, step=0, world=2, **kw):
    r = {"schema": "torsh-live/1", "time": 1.0 + step, "job": "j", "rank": rank, "world_size": world,
         "source": "ddp", "step": step, "step_s": 0.01, "compute_s": 0.008, "comm_s": 0.001, "compress_s": 0.001,
         "wire_bytes": 1000, "payload_bytes": 4000, "sent_bytes": 1000, "link_Bps": 1e9, "ratio": 4.0,
         "error": None, "nonfinite": 0, "compressor": "int8", "switch": None, "alerts": []}  # fmt: skip
    r.update(kw)
    return r


def _append(path, recs, tail: str = ""):
    with open(path, "a") as f:
        for r in recs:
            f.write(json.dumps(r) + "\n")
        f.write(tail)


def test_dir_source_reads_complete_lines_and_follows_rotation(tmp_path):
    src = DirSource(str(tmp_path))
    p = tmp_path / "rank0.jsonl"
    line = json.dumps(_rec(step=2))
    _append(p, [_rec(step=0), _rec(step=1)], tail=line[:20])  # a line still being written
    assert [r["step"] for r in src.read()] == [0, 1]
    assert src.read() == []
    with open(p, "a") as f:
        f.write(line[20:] + "\n")
    assert [r["step"] for r in src.read()] == [2]
    _append(p, [_rec(step=3)])
    os.replace(p, tmp_path / "rank0.jsonl.1")  # rotated: step 3 is only in the old file now
    _append(p, [_rec(step=4)])
    _append(tmp_path / "rank1.jsonl", [_rec(rank=1, step=0)])
    got = src.read()
    assert sorted((r["rank"], r["step"]) for r in got) == [(0, 3), (0, 4), (1, 0)]


def test_dir_source_follows_the_publishers_own_rotation(tmp_path):
    src = DirSource(str(tmp_path))
    seen = []
    with Publisher(LiveSpec(dir=str(tmp_path), max_bytes=4096, keep=3)) as pub:
        for s in range(120):
            pub.publish({k: v for k, v in _rec(step=s).items() if k not in ("schema", "time", "job", "alerts")})
            if s % 7 == 0:
                seen += src.read()
    seen += src.read()
    assert [r["step"] for r in seen] == list(range(120))  # every record once, in order, across 3+ rotations
    assert len(os.listdir(tmp_path)) == 4


def test_state_marks_the_slowest_rank_and_keeps_sparklines():
    st = TopState(window=5)
    st.update([_rec(rank=r, step=s, compute_s=0.02 if r == 1 else 0.008, step_s=0.01 + s * 1e-3)
               for r in range(3) for s in range(8)])  # fmt: skip
    snap = st.snapshot()
    assert [(x["rank"], x["step"], x["slowest"]) for x in snap["ranks"]] == [(0, 7, False), (1, 7, True), (2, 7, False)]
    assert len(snap["ranks"][0]["step_s_history"]) == 5
    assert sparkline([1, 2, 3, 4]) == "▁▃▆█" and sparkline([2, 2]) == "▁▁" and sparkline([]) == ""
    # rank 1 is 2.5x the median for 8 steps: a straggler from its 5th slow step (step 4)
    hist = [a for a in snap["history"] if a["kind"] == "straggler"]
    assert [(a["rank"], a["step"]) for a in hist] == [(1, 4)]


def test_alert_specs_are_checked():
    from torsh_kernels.errors import ArgumentTypeError, InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="link_drop"):
        AlertSpec(link_drop=1.0)
    with pytest.raises(InvalidArgumentError, match="straggler"):
        AlertSpec(straggler=0)
    with pytest.raises(ArgumentTypeError, match="straggler_steps"):
        AlertSpec(straggler_steps=2.5)
    with pytest.raises(ArgumentTypeError, match="nonfinite"):
        AlertSpec(nonfinite="yes")


def test_link_drop_needs_its_steps_and_ignores_short_dips():
    ra = RankAlerts(AlertSpec(link_steps=3))
    kinds = []
    rates = [1e9] * 10 + [1e8] * 2 + [1e9] * 3 + [1e8] * 4
    for s, rate in enumerate(rates):
        kinds.append([a["kind"] for a in ra.update(_rec(step=s, link_Bps=rate))])
    assert [s for s, k in enumerate(kinds) if "link_drop" in k] == [17, 18]  # the 3rd and 4th slow steps in a row
    # a compressor switch starts a new level: its smaller payload's lower rate is no link drop
    ra = RankAlerts(AlertSpec(link_steps=3))
    recs = [_rec(step=s, link_Bps=1e9 if s < 10 else 1e8, compressor="none" if s < 10 else "fp16") for s in range(20)]
    assert not [a for r in recs for a in ra.update(r) if a["kind"] == "link_drop"]


def test_job_link_is_judged_on_the_highest_rate():
    job = JobAlerts(AlertSpec(link_steps=3))
    # rank 1's rate drops (it waits for a slow rank 0), rank 0's does not: no link drop
    job.update([_rec(rank=r, step=s, link_Bps=1e9 if r == 0 or s < 10 else 1e7) for r in (0, 1) for s in range(20)])
    assert not [a for a in job.history() if a["kind"] == "link_drop"]
    job2 = JobAlerts(AlertSpec(link_steps=3))
    job2.update([_rec(rank=r, step=s, link_Bps=1e9 if s < 10 else 1e7) for r in (0, 1) for s in range(20)])
    assert [a["step"] for a in job2.history() if a["kind"] == "link_drop"] == [12]


def test_once_json_and_table(tmp_path, capsys):
    _append(tmp_path / "rank0.jsonl", [_rec(step=s) for s in range(3)])
    _append(tmp_path / "rank1.jsonl", [_rec(rank=1, step=s, nonfinite=int(s == 2)) for s in range(3)])
    assert main(["top", str(tmp_path), "--once", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [(r["rank"], r["step"]) for r in doc["ranks"]] == [(0, 2), (1, 2)]
    assert [(a["kind"], a["rank"]) for a in doc["alerts"]] == [("nonfinite", 1)]
    assert main(["top", str(tmp_path), "--once"]) == 0
    out = capsys.readouterr().out
    assert "ALERT nonfinite (rank 1, step 2)" in out and "int8" in out


def test_bad_sources_are_typed_errors(tmp_path, capsys):
    assert main(["top", str(tmp_path / "missing"), "--once"]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["top", str(tmp_path), "--once"]) == 2  # empty
    assert "no live records" in capsys.readouterr().err
    assert main(["top", "ftp://x/metrics", "--once"]) == 2
    assert main(["top", str(tmp_path), "--json"]) == 2  # --json needs --once
    assert main(["top", str(tmp_path), "--once", "--straggler", "-1"]) == 2
    with pytest.raises(SourceError, match="cannot read"):
        UrlSource("http://127.0.0.1:9/metrics", timeout=2).read()  # nothing listens on port 9


def test_url_mode_scrapes_a_real_prometheus_endpoint(tmp_path):
    pytest.importorskip("prometheus_client")
    with Publisher(LiveSpec(prometheus=0, addr="127.0.0.1", job="p")) as pub:
        for s in range(4):
            base = {k: v for k, v in _rec(step=s, wire_bytes=1000 + s).items()
                    if k not in ("schema", "time", "job", "alerts")}  # fmt: skip
            pub.publish(base)
        src = UrlSource(pub.prometheus_url.removesuffix("/metrics"))  # a bare host:port gets /metrics
        recs = src.read()
        assert [(r["job"], r["rank"], r["source"], r["step"], r["compressor"]) for r in recs] == [
            ("p", 0, "ddp", 3, "int8")
        ]
        assert recs[0]["wire_bytes"] == (1000 + 1001 + 1002 + 1003) // 4  # the counters over the steps seen
        assert src.read() == []  # no new step: no new record
        pub.publish({**base, "step": 4, "compressor": "topk:0.01", "switch": {"from": "int8", "to": "topk:0.01"}})
        again = src.read()
        assert again[0]["step"] == 4 and again[0]["compressor"] == "topk:0.01" and again[0]["switch"]["from"] == "int8"
        text = __import__("urllib.request").request.urlopen(pub.prometheus_url).read().decode()
    parsed = parse_prometheus(text)
    assert parsed[("p", 0, "ddp")]["counters"]["steps"] == 5  # summed over both compressors' series


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_live_view_in_tmux(tmp_path):
    sess = f"torsh-top-{os.getpid()}"
    _append(tmp_path / "rank0.jsonl", [_rec(step=0)])
    # (a detached session's pane may stay 80 columns whatever -x says: the width rich reads is given too)
    cmd = f"env COLUMNS=200 LINES=50 {sys.executable} -m torsh_kernels.apps.cli top {tmp_path} --interval 0.2"
    subprocess.run(["tmux", "new-session", "-d", "-s", sess, "-x", "200", "-y", "50", cmd], check=True)
    try:

        def screen() -> str:
            return subprocess.run(["tmux", "capture-pane", "-p", "-t", sess], capture_output=True, text=True).stdout

        def wait_for(text: str, timeout: float = 30.0) -> str:
            t_end = time.monotonic() + timeout
            while time.monotonic() < t_end:
                s = screen()
                if text in s:
                    return s
                time.sleep(0.2)
            raise AssertionError(f"{text!r} never appeared; the screen:\n{screen()}")

        wait_for("torsh top: j")
        # rank 1 joins, slow: after 5 of its steps above the median, the view names the straggler
        for s in range(1, 9):
            _append(tmp_path / "rank0.jsonl", [_rec(step=s)])
            _append(tmp_path / "rank1.jsonl", [_rec(rank=1, step=s - 1, compute_s=0.05)])
        s = wait_for("ALERT straggler (rank 1")
        assert "◀ slowest" in s, s
        row = next(ln for ln in s.splitlines() if "│    1 │" in ln)
        assert "◀ slowest" in row
    finally:
        subprocess.run(["tmux", "kill-session", "-t", sess], capture_output=True)


def test_a_restarted_job_in_the_same_directory_is_shown_and_judged_anew(tmp_path):
    src, st = DirSource(str(tmp_path)), TopState()
    _append(tmp_path / "rank0.jsonl", [_rec(step=s, world=1) for s in range(30)])
    st.update(src.read())
    # the job restarts into the same files: steps from 0 again, written later
    _append(tmp_path / "rank0.jsonl", [_rec(step=s, world=1, time=100.0 + s, step_s=0.05, nonfinite=int(s == 10))
                                       for s in range(20)])  # fmt: skip
    st.update(src.read())
    snap = st.snapshot()
    assert snap["ranks"][0]["step"] == 19 and snap["ranks"][0]["step_s"] == 0.05
    assert [(a["kind"], a["step"]) for a in snap["history"]] == [("nonfinite", 10)]


def _serve(body: bytes):
    import http.server
    import threading

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body() if callable(body) else body)

        def log_message(self, *a):
            pass

    hs = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=hs.serve_forever, daemon=True).start()
    return hs


def test_endpoints_at_different_steps_are_compared_scrape_by_scrape():
    # each scrape catches the ranks at different steps (rank r at 2i + r); rank 1 computes 3.75x the others
    state = {"i": 0}

    def body():
        i = state["i"]
        out = []
        for r in range(3):
            lab = f'compressor="int8",job="u",rank="{r}",source="ddp"'
            out += [f"torsh_step{{{lab}}} {2 * i + r}", f"torsh_step_seconds{{{lab}}} 0.03",
                    f"torsh_compute_seconds{{{lab}}} {0.03 if r == 1 else 0.008}", f"torsh_world_size{{{lab}}} 3",
                    f"torsh_steps_total{{{lab}}} {2 * i + r + 1}"]  # fmt: skip
        return ("\n".join(out) + "\n").encode()

    hs = _serve(body)
    try:
        u, st = UrlSource(f"http://127.0.0.1:{hs.server_address[1]}"), TopState()
        for i in range(8):
            state["i"] = i
            st.update(u.read())
    finally:
        hs.shutdown()
    strag = [a for a in st.snapshot()["history"] if a["kind"] == "straggler"]
    assert [a["rank"] for a in strag] == [1]


def test_a_port_that_is_not_http_is_a_typed_error():
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def banner():
        c, _ = srv.accept()
        c.sendall(b"SSH-2.0-OpenSSH_9.0\r\n")
        c.close()

    threading.Thread(target=banner, daemon=True).start()
    try:
        with pytest.raises(SourceError, match="cannot read"):
            UrlSource(f"http://127.0.0.1:{srv.getsockname()[1]}").read()
    finally:
        srv.close()


def test_a_narrow_terminal_keeps_what_it_shows_whole():
    from rich.console import Console

    from torsh_kernels.profiling.top import render

    st = TopState()
    st.update([_rec(rank=r, step=s, error=0.5) for r in range(2) for s in range(50)])
    for width in (80, 120, 200):
        con = Console(width=width, record=True, force_terminal=True)
        con.print(render(st, [DirSource("live")], width=width))
        text = con.export_text()
        table = [ln for ln in text.splitlines() if ln.startswith(("┃", "│"))]
        assert "…" not in "".join(table), (width, text)
        assert "step time" in table[0] and "compute" in table[0]
        assert ("error" in table[0]) == (width >= 150)
