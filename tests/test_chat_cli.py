"""`tokenmill chat` in a real terminal (tmux: send-keys and capture-pane) on the bundled model: two turns that keep
their history, /clear, a Ctrl-C in the middle of a reply that stops the reply and not the program, /save, and a
clean exit."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytest_plugins = ["tests.server_fixtures"]

TMUX = shutil.which("tmux")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(TMUX is None, reason="no tmux (Debian: apt-get install tmux)")]
MARK = re.compile(r"\[(stopped: )?(\d+ tokens, TTFT \d+ ms|no tokens)")


class Pane:
    """A detached tmux session running one command, read back as the screen shows it."""

    def __init__(self, command: str):
        self.name = f"tokenmill-{uuid.uuid4().hex[:8]}"
        subprocess.run([TMUX, "new-session", "-d", "-s", self.name, "-x", "200", "-y", "50", command], check=True)

    def keys(self, *keys: str) -> None:
        subprocess.run([TMUX, "send-keys", "-t", self.name, *keys], check=True)

    def line(self, text: str) -> None:
        self.keys("-l", text)
        self.keys("Enter")

    def text(self) -> str:
        return subprocess.run([TMUX, "capture-pane", "-p", "-J", "-S", "-5000", "-t", self.name],
                              capture_output=True, text=True, check=True).stdout

    def wait(self, ok, what: str, timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            screen = self.text()
            if ok(screen):
                return screen
            time.sleep(0.1)
        raise AssertionError(f"waited {timeout:g} s for {what}; the screen:\n{self.text()}")

    def close(self) -> None:
        subprocess.run([TMUX, "kill-session", "-t", self.name], capture_output=True)


def test_a_conversation_in_the_terminal(tmp_path: Path) -> None:
    saved = tmp_path / "chat.json"
    cmd = (f"{shlex.quote(sys.executable)} -m tokenmill.cli chat --temperature 0 --max-tokens 400 "
           f"--max-model-len 2048 --kv-cache-memory-gb 0.1; echo EXIT=$?; sleep 60")
    pane = Pane(f"cd {shlex.quote(os.getcwd())} && {cmd}")
    try:
        pane.wait(lambda s: ">>> " in s, "the prompt")
        pane.line("Name one colour of the rainbow.")
        pane.wait(lambda s: len(MARK.findall(s)) == 1, "the first reply")
        pane.line("Name another one.")
        pane.wait(lambda s: len(MARK.findall(s)) == 2, "the second reply")
        pane.line(f"/save {saved}")
        pane.wait(lambda s: "(saved 4 messages" in s, "/save")
        assert [m["role"] for m in json.loads(saved.read_text())["messages"]] == ["user", "assistant"] * 2
        pane.line("/clear")
        pane.wait(lambda s: "(history cleared)" in s, "/clear")
        pane.line("Write a very long story about a dragon who learns to bake bread.")

        def replying(screen: str) -> bool:
            after = screen.rsplit("learns to bake bread.", 1)[-1]
            return len(after.strip()) > 30
        pane.wait(replying, "the story to start")
        pane.keys("C-c")
        screen = pane.wait(lambda s: "[stopped: " in s, "Ctrl-C to stop the reply")
        stopped = int(re.search(r"\[stopped: (\d+) tokens", screen).group(1))
        assert 0 < stopped < 400
        pane.wait(lambda s: s.rstrip().endswith(">>>"), "the prompt after the stopped reply")
        pane.line(f"/save {saved}")
        pane.wait(lambda s: "(saved 2 messages" in s, "/save after /clear")
        story = json.loads(saved.read_text())["messages"]
        assert story[0]["content"].startswith("Write a very long story") and story[1]["content"]
        pane.line("/exit")
        pane.wait(lambda s: "EXIT=0" in s, "a clean exit")
    finally:
        pane.close()


def test_attached_to_a_running_server(live_server) -> None:
    """--url: the replies stream from the server's /v1/chat/completions (its API key sent), and stopping between
    chunks ends the stream there; a wrong URL says what to do."""
    import argparse

    from tests.server_fixtures import API_KEY
    from tokenmill.chat_cli import RemoteChat
    args = argparse.Namespace(url=live_server.url + "/v1", api_key=API_KEY, max_tokens=8, temperature=0.0,
                              top_p=1.0, seed=None)
    chat = RemoteChat(args)
    assert chat.model == "tiny-chat"
    pieces = list(chat.stream([{"role": "user", "content": "hi"}], lambda: False))
    assert pieces and pieces[-1][1] == 8
    seen: list = []
    for piece in chat.stream([{"role": "user", "content": "hi"}], lambda: bool(seen)):
        seen.append(piece)
    assert len(seen) == 1
    with pytest.raises(ValueError, match=r"no server answers at http://127.0.0.1:9 \(.*\); start one with `tokenmill "
                                         r"serve`"):
        RemoteChat(argparse.Namespace(**{**vars(args), "url": "http://127.0.0.1:9"}))
