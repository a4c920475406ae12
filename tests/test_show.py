"""`rollout show`: the terminal view of a rollout (text, finish, acceptance, settings; --tokens:
each token's text, log-prob, width, alternatives and step) and the HTML page, rendered in headless
Chromium: its script colours every token by log-prob and support width, groups them by verify
step and outlines each step's target token, and the screenshot shows those colours."""

from __future__ import annotations

import html.parser
import re
import shutil
import struct
import subprocess
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from rollout.cli import main
from rollout.engine.config import DEFAULT_MODEL
from rollout.engine.params import SamplingParams
from rollout.outputs import SampleOutput
from rollout.schema import schema_with_metadata, to_record_batch

LOGPROBS = [0.0, -0.5, -6.5, -3.0, -1.0, -0.2]  # "a" "b" "\n" "c" and the two bytes of "é"


def _rollout(path: Path, model: str = "tiny-qwen3") -> Path:
    tokens = list("ab\ncé".encode())
    a = SampleOutput("req", 0, 0, prompt_token_ids=list(b"def f():"), token_ids=tokens, token_logprobs=LOGPROBS,
                     finish_reason="stop", accept_lengths=[1, 3, 2], params=SamplingParams(temperature=0.7, top_k=5),
                     mask="support", stop_reason="cé")  # fmt: skip
    widths = [1, 3, 5, 2, 4, 2]
    a.support_ids = [[t] + [200 + k for k in range(w - 1)] for t, w in zip(tokens, widths)]
    a.support_logprobs = [[lp] + [lp - 1 - k for k in range(w - 1)] for lp, w in zip(LOGPROBS, widths)]
    b = SampleOutput("req", 1, 0, prompt_token_ids=[120], token_ids=[120, 121], token_logprobs=[-0.1, -4.0],
                     accept_lengths=[1, 1], params=SamplingParams(temperature=0.0))  # fmt: skip
    table = pa.Table.from_batches([to_record_batch([a, b], schema_with_metadata(model, "", "none", "support", 5))])
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table)
    return path


def test_the_terminal_view(tmp_path, capsys):
    path = _rollout(tmp_path / "r.arrow")
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "── prompt 0 · sample 0 ── finish stop ('cé') · 6 tokens · 3 verify steps, 2.00 tokens/step" in out
    assert "output: 'ab\\ncé'" in out and "prompt: 'def f():'" in out
    assert "temperature 0.7 · top_k 5" in out and "mask support" in out and "mask none" in out
    assert main(["show", str(path), "--tokens", "--samples", "1"]) == 0
    out = capsys.readouterr().out
    rows = {int(line.split()[0]): line for line in out.splitlines() if re.match(r"^\s+\d+\s+\d+\*?\s", line)}
    assert len(rows) == 6 and "... 1 more samples" in out
    assert "'\\n'" in rows[2] and "-6.500" in rows[2] and " 5 " in rows[2] and rows[2].endswith(" 0.000")
    assert rows[0].split()[1] == "0*" and rows[1].split()[1] == "1" and rows[3].split()[1] == "1*"
    assert "''" in rows[4] and "'é'" in rows[5]  # the first byte of "é" shows nothing, the second the character


def test_without_a_tokenizer_tokens_show_as_ids(tmp_path, capsys):
    path = _rollout(tmp_path / "o.arrow", model="other")
    assert main(["show", str(path), "--tokens"]) == 0
    out = capsys.readouterr().out
    assert "'⟨97⟩'" in out and "output: '⟨97⟩⟨98⟩" in out
    assert main(["show", str(path), "--tokens", "--tokenizer", str(DEFAULT_MODEL)]) == 0
    assert "output: 'ab\\ncé'" in capsys.readouterr().out
    assert main(["show", str(tmp_path / "missing.arrow")]) == 2
    assert "rollout show: file: cannot read" in capsys.readouterr().err
    (tmp_path / "junk.arrow").write_bytes(b"not arrow at all")
    assert main(["show", str(tmp_path / "junk.arrow")]) == 2
    assert "is not an Arrow IPC file or stream" in capsys.readouterr().err
    old = pa.table({"token_ids": pa.array([[1]], pa.list_(pa.int32()))})
    with pa.ipc.new_file(str(tmp_path / "old.arrow"), old.schema) as writer:
        writer.write_table(old)
    assert main(["show", str(tmp_path / "old.arrow")]) == 2
    assert "not a rollout in this version's schema: no column(s) ['request_id'" in capsys.readouterr().err


class _Spans(html.parser.HTMLParser):
    """Every span's attributes, in document order."""

    def __init__(self):
        super().__init__()
        self.spans: list[dict[str, str]] = []

    def handle_starttag(self, tag, attrs):
        if tag == "span":
            self.spans.append({k: v or "" for k, v in attrs})


def _browser() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("no Chromium here to render the page (Debian: apt-get install chromium; .ci/run installs it)")
    return found


def _chromium(browser: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--force-device-scale-factor=1", "--hide-scrollbars"]
    return subprocess.run([browser, *flags, *args], capture_output=True, text=True, timeout=120, check=True)


def _rgb(style: str, prop: str) -> tuple[int, int, int]:
    found = re.search(rf"{prop}: rgb\((\d+), (\d+), (\d+)\)", style)
    assert found, f"no {prop} in {style!r}"
    return tuple(int(x) for x in found.groups())


def test_the_html_page_in_a_browser(tmp_path, capsys):
    browser = _browser()
    page = tmp_path / "page.html"
    assert main(["show", str(_rollout(tmp_path / "r.arrow")), "--html", str(page)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert "http" not in page.read_text().replace("https://", "")  # nothing fetched (no src=, no link)
    dom = _chromium(browser, tmp_path, "--dump-dom", page.as_uri()).stdout
    parser = _Spans()
    parser.feed(dom)
    toks = [s for s in parser.spans if "tok" in s.get("class", "").split()]
    steps = [s for s in parser.spans if s.get("class") == "step"]
    assert len(toks) == 8 and len(steps) == 5  # 6 + 2 tokens; 3 + 2 verify steps
    assert [("target" in t["class"]) for t in toks] == [True, False, False, True, False, True, True, True]
    assert ["partial" in t["class"] for t in toks].count(True) == 1
    background = [_rgb(t["style"], "background-color") for t in toks]  # set by the page's script
    underline = [_rgb(t["style"], "border-bottom-color") for t in toks]
    green, red = background[0], background[2]  # log-prob 0 and -6.5
    assert green[1] > green[0] + 50 and red[0] > red[1] + 50
    assert background[3][0] > 200 and background[3][1] > 200  # -3: yellow
    assert underline[2] != underline[0] and underline[6] == underline[7]  # width 5 vs 1; no masks: grey
    assert 'title="id 10 · log-prob -6.5000 (p 0.0015) · width 5 · step 1 (draft)' in dom  # the hover text
    shot = tmp_path / "shot.png"
    _chromium(browser, tmp_path, "--window-size=800,500", f"--screenshot={shot}", page.as_uri())
    pixels = Counter(map(tuple, _png_rgb(shot.read_bytes()).reshape(-1, 3).tolist()))
    for colour in (green, red, background[3]):  # what the page shows, not only its markup
        assert pixels[colour] > 20, f"{colour} is not on the screenshot"


def _png_rgb(data: bytes) -> np.ndarray:
    """A non-interlaced 8-bit RGB / RGBA PNG -> [H, W, 3] uint8 (filters 0-4 undone)."""
    width, height, depth, kind, _, _, interlace = struct.unpack(">IIBBBBB", data[16:29])
    assert depth == 8 and kind in (2, 6) and interlace == 0
    channels = 3 if kind == 2 else 4
    chunks, i = [], 8
    while i < len(data):
        (n,) = struct.unpack(">I", data[i : i + 4])
        if data[i + 4 : i + 8] == b"IDAT":
            chunks.append(data[i + 8 : i + 8 + n])
        i += 12 + n
    raw = np.frombuffer(zlib.decompress(b"".join(chunks)), np.uint8).reshape(height, 1 + width * channels)
    out = np.zeros((height, width * channels), np.int32)
    prev = np.zeros(width * channels, np.int32)
    for r in range(height):
        kind_r, row = raw[r, 0], raw[r, 1:].astype(np.int32)
        if kind_r == 1:
            row = np.cumsum(row.reshape(width, channels), axis=0).reshape(-1) % 256
        elif kind_r == 2:
            row = (row + prev) % 256
        elif kind_r in (3, 4):
            row = _sequential(row, prev, channels, kind_r)
        out[r] = prev = row
    return out.reshape(height, width, channels)[..., :3].astype(np.uint8)


def _sequential(row: np.ndarray, prev: np.ndarray, channels: int, kind: int) -> np.ndarray:
    """Average (3) and Paeth (4) filters, byte by byte."""
    recon = [0] * len(row)
    for x in range(len(row)):
        a = recon[x - channels] if x >= channels else 0
        b = int(prev[x])
        c = int(prev[x - channels]) if x >= channels else 0
        if kind == 3:
            pred = (a + b) // 2
        else:
            p = a + b - c
            pa_, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            pred = a if pa_ <= pb and pa_ <= pc else b if pb <= pc else c
        recon[x] = (int(row[x]) + pred) % 256
    return np.array(recon, np.int32)
