"""Hugging Face Hub ids as models (``--model owner/name[@revision]``), through the real download code.

Nothing of memfit's is mocked: the CLI runs in a fresh process (huggingface_hub reads ``HF_HOME``,
``HF_ENDPOINT``, ``HF_HUB_OFFLINE`` and ``HF_TOKEN`` when it is imported) against

- a pre-filled HF cache (the documented layout ``models--owner--name/snapshots/<commit>/config.json`` +
  ``refs/main``) with ``HF_HUB_OFFLINE=1``;
- a local stand-in for the Hub on 127.0.0.1: a tiny ``http.server`` answering what ``hf_hub_download``
  asks for a config.json (``HEAD``/``GET /{repo}/resolve/{revision}/config.json`` with ``X-Repo-Commit``,
  ``ETag``, ``Content-Length``; errors as the Hub sends them, ``X-Error-Code`` GatedRepo / RepoNotFound /
  RevisionNotFound), and a closed port for an unreachable Hub.

Each failure is exit status 2 and exactly one ``error: ...`` line, no traceback.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import pytest

from memfit.spec.model import PRESET_DIR, HubId, hub_id

ROOT = Path(__file__).resolve().parents[2]
CONFIG = (PRESET_DIR / "qwen2.5-7b.json").read_bytes()
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_memfit_test_token"
POOL = "1xA100-80GB"

# The child runs `memfit` once per command line given (JSON), one process per environment, and prints
# each command's (exit status, stdout, stderr) as JSON. For the unreachable Hub it skips the sleeps
# between huggingface_hub's 5 connection retries (1-8 s each, 23 s), nothing else.
RUN = """
import contextlib, io, json, sys
from memfit.cli.app import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as exc:
            code = exc.code or 0
    results.append((code, out.getvalue(), err.getvalue()))
sys.__stdout__.write(json.dumps(results))
"""
RUN_NO_SLEEP = "import time; time.sleep = lambda s: None\n" + RUN


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def do_HEAD(self):
        self._answer(body=False)

    def do_GET(self):
        self._answer(body=True)

    def _answer(self, body: bool) -> None:
        hub = self.server
        hub.requests.append((self.command, self.path, self.headers.get("authorization")))
        parts = unquote(self.path.split("?")[0]).lstrip("/").split("/")
        if len(parts) < 5 or parts[2] != "resolve":
            return self._error(404, "EntryNotFound", "not a resolve url")
        repo, revision, filename = "/".join(parts[:2]), "/".join(parts[3:-1]), parts[-1]
        entry = hub.repos.get(repo)
        if entry is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        if entry.get("gated") and self.headers.get("authorization") != f"Bearer {TOKEN}":
            code = 403 if self.headers.get("authorization") else 401
            return self._error(code, "GatedRepo", f"Access to model {repo} is restricted.")
        if revision not in ("main", COMMIT):
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        data = entry["files"].get(filename)
        if data is None:
            return self._error(404, "EntryNotFound", f"{filename} does not exist on \"{revision}\"")
        self.send_response(200)
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("ETag", f'"{abs(hash(data)):x}"')
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _error(self, code: int, error_code: str, message: str) -> None:
        payload = json.dumps({"error": message}).encode()
        self.send_response(code)
        self.send_header("X-Error-Code", error_code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)


@pytest.fixture
def hub():
    """The stand-in Hub on 127.0.0.1 (a thread; shut down and joined after the test)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.requests = []
    server.repos = {
        "Qwen/Qwen2.5-7B": {"files": {"config.json": CONFIG}},
        "meta-llama/Gated-7B": {"files": {"config.json": CONFIG}, "gated": True},
        "acme/encoder": {"files": {"config.json": json.dumps({"model_type": "t5", "d_model": 512}).encode()}},
        "acme/no-config": {"files": {}},
    }
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _env(home: Path, endpoint: str | None = None, offline: bool = False, token: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(home), HF_HUB_DISABLE_TELEMETRY="1", PYTHONPATH=str(ROOT))
    if endpoint:
        env["HF_ENDPOINT"] = endpoint
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    if token:
        env["HF_TOKEN"] = token
    return env


def memfit_each(env: dict, *commands: list[str], runner: str = RUN) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of each `memfit` command line, run in one fresh process with ``env``."""
    p = subprocess.run([sys.executable, "-c", runner, json.dumps(list(commands))], env=env, capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0 and not p.stderr, p.stderr  # nothing escaped main(): no traceback, no warning
    return [tuple(r) for r in json.loads(p.stdout)]


def memfit(env: dict, *argv: str, runner: str = RUN) -> tuple[int, str, str]:
    return memfit_each(env, list(argv), runner=runner)[0]


def memfit_here(capsys, *argv: str) -> str:
    """stdout of `memfit argv` in this process (a local config.json: no Hub involved)."""
    from cli_helper import run_cli

    code, out, err = run_cli(capsys, *argv)
    assert code == 0, err
    return out


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fill_cache(home: Path, repo: str, config: bytes) -> Path:
    """The HF cache layout huggingface_hub documents: a snapshot per commit, refs/main naming it."""
    folder = home / "hub" / ("models--" + repo.replace("/", "--"))
    (folder / "snapshots" / COMMIT).mkdir(parents=True)
    (folder / "snapshots" / COMMIT / "config.json").write_bytes(config)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(COMMIT)
    return folder


def _numbers(out: str) -> dict:
    """A plan's or estimate's JSON without the model's name (a Hub id vs a folder name)."""
    data = json.loads(out)

    def strip(node):
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k not in ("name", "model_name", "source")}
        if isinstance(node, list):
            return [strip(v) for v in node]
        return node

    return strip(data)


def _one_error_line(code: int, err: str) -> str:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


# ------------------------------------------------------------------ the id's shape
@pytest.mark.parametrize("text, want", [
    ("Qwen/Qwen2.5-7B", HubId("Qwen/Qwen2.5-7B")),
    ("Qwen/Qwen2.5-7B@v1.0", HubId("Qwen/Qwen2.5-7B", "v1.0")),
    ("org/name@refs/pr/1", HubId("org/name", "refs/pr/1")),
    ("llama-2-7b", None), ("./org/name", None), ("/abs/org", None), ("a/b/c", None), ("org/config.json", None),
    ("org/name@", None),
])
def test_hub_id_shape(text, want):
    assert hub_id(text) == want


def test_a_local_path_wins_over_a_hub_id(tmp_path, monkeypatch):
    (tmp_path / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hub_id("org/name") is None


# ------------------------------------------------------------------ a pre-filled cache, offline
def test_offline_cache_plans_and_estimates_as_the_file(tmp_path, capsys):
    _fill_cache(tmp_path / "hf", "Qwen/Qwen2.5-7B", CONFIG)
    cfg = tmp_path / "local" / "config.json"
    cfg.parent.mkdir()
    cfg.write_bytes(CONFIG)
    env = _env(tmp_path / "hf", endpoint=f"http://127.0.0.1:{_closed_port()}", offline=True)
    commands = (["plan", "--gpus", POOL, "--json"], ["estimate", "--gpus", POOL, "--seq-len", "1024", "--json"])
    results = memfit_each(env, *([c[0], "--model", "Qwen/Qwen2.5-7B", *c[1:]] for c in commands))
    for cmd, (code, out, err) in zip(commands, results):
        assert code == 0, err
        assert "Qwen/Qwen2.5-7B" in out
        assert _numbers(out) == _numbers(memfit_here(capsys, cmd[0], "--model", str(cfg), *cmd[1:]))


def test_offline_with_nothing_cached_is_one_line(tmp_path):
    code, _, err = memfit(_env(tmp_path / "hf", offline=True), "plan", "--model", "Qwen/Qwen2.5-7B",
                          "--gpus", POOL)
    assert _one_error_line(code, err) == (
        "error: model 'Qwen/Qwen2.5-7B': config.json is not in the cache and the Hub is unreachable "
        "(HF_HUB_OFFLINE=1?): download it first (hf download Qwen/Qwen2.5-7B config.json), or pass a "
        "local folder")


# ------------------------------------------------------------------ the stand-in Hub
def test_download_then_offline(hub, tmp_path, capsys):
    home = tmp_path / "hf"
    code, out, err = memfit(_env(home, hub.url), "plan", "--model", "Qwen/Qwen2.5-7B", "--gpus", POOL, "--json")
    assert code == 0, err
    assert [(m, p) for m, p, _ in hub.requests] == [
        ("HEAD", "/Qwen/Qwen2.5-7B/resolve/main/config.json"), ("GET", "/Qwen/Qwen2.5-7B/resolve/main/config.json")]
    cached = home / "hub" / "models--Qwen--Qwen2.5-7B" / "snapshots" / COMMIT / "config.json"
    assert cached.read_bytes() == CONFIG
    # the same numbers as the file, and from the cache once the Hub is gone
    cfg = tmp_path / "config.json"
    cfg.write_bytes(CONFIG)
    local = memfit_here(capsys, "plan", "--model", str(cfg), "--gpus", POOL, "--json")
    code, again, err = memfit(_env(home, offline=True), "plan", "--model", "Qwen/Qwen2.5-7B", "--gpus", POOL,
                              "--json")
    assert code == 0, err
    assert _numbers(out) == _numbers(local) == _numbers(again)


def test_a_pinned_revision(hub, tmp_path):
    code, out, err = memfit(_env(tmp_path / "hf", hub.url), "estimate", "--model", f"Qwen/Qwen2.5-7B@{COMMIT}",
                            "--gpus", POOL, "--json")
    assert code == 0, err
    assert hub.requests[0][:2] == ("HEAD", f"/Qwen/Qwen2.5-7B/resolve/{COMMIT}/config.json")


GATED = ("error: model 'meta-llama/Gated-7B' is gated: accept its licence on the Hub and set HF_TOKEN, or pass "
         "a local folder")
ERRORS = [  # without a token
    ("meta-llama/Gated-7B", GATED),  # 401 GatedRepo
    ("acme/missing", "error: model 'acme/missing': not a local path, and no such model repository on the Hub "
                     "(a private one needs HF_TOKEN); check the id, or pass a local folder"),
    ("Qwen/Qwen2.5-7B@v9", "error: model 'Qwen/Qwen2.5-7B@v9': the Hub repository Qwen/Qwen2.5-7B has no "
                           "revision 'v9'; give an existing branch, tag or commit after '@', or pass a local folder"),
    ("acme/no-config", "error: model 'acme/no-config': the Hub repository has no config.json (not a "
                       "transformers model?); pass a local folder with one instead"),
    ("acme/encoder", "error: acme/encoder config.json: model_type 't5' is not supported; supported: llama, "),
]


def test_gated_missing_revision_file_or_architecture(hub, tmp_path):
    results = memfit_each(_env(tmp_path / "hf", hub.url), *(["plan", "--model", m, "--gpus", POOL] for m, _ in ERRORS))
    for (model, want), (code, _, err) in zip(ERRORS, results):
        line = _one_error_line(code, err)
        assert line.startswith(want) if model == "acme/encoder" else line == want, model


def test_gated_repo_with_a_token(hub, tmp_path):
    code, _, err = memfit(_env(tmp_path / "hf", hub.url, token="hf_not_granted"), "plan", "--model",
                          "meta-llama/Gated-7B", "--gpus", POOL)
    assert _one_error_line(code, err) == GATED  # 403 GatedRepo: a token without access
    code, out, err = memfit(_env(tmp_path / "hf", hub.url, token=TOKEN), "plan", "--model",
                            "meta-llama/Gated-7B", "--gpus", POOL, "--json")
    assert code == 0, err  # HF_TOKEN reaches the Hub through huggingface_hub
    assert hub.requests[-1][2] == f"Bearer {TOKEN}"


def test_unreachable_hub_with_an_empty_cache(tmp_path):
    code, _, err = memfit(_env(tmp_path / "hf", f"http://127.0.0.1:{_closed_port()}"), "plan", "--model",
                          "Qwen/Qwen2.5-7B", "--gpus", POOL, runner=RUN_NO_SLEEP)
    assert _one_error_line(code, err) == (
        "error: model 'Qwen/Qwen2.5-7B': config.json is not in the cache and the Hub is unreachable "
        "(HF_HUB_OFFLINE=1?): download it first (hf download Qwen/Qwen2.5-7B config.json), or pass a "
        "local folder")
