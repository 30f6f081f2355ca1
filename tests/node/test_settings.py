"""The node's settings (gpuswarm.node.settings): a TOML file, then GPUSWARM_NODE_* variables, then flags; and
`gpuswarm node init`, which writes the commented file, run as a real subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from gpuswarm.node.settings import NodeSettings, config_file, load, render_toml
from pydantic import ValidationError

ROOT = Path(__file__).resolve().parents[2]


def gpuswarm(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpuswarm.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "COLUMNS": "200", **(env or {})})


def test_the_file_then_the_environment_then_flags(tmp_path, monkeypatch):
    path = tmp_path / "node.toml"
    path.write_text('coordinator = "http://file:1"\nprice = 2.0\nhost = "10.0.0.5"\nendpoints = ["1.2.3.4:51820"]\n')
    monkeypatch.setenv("GPUSWARM_NODE_PRICE", "3.5")
    monkeypatch.setenv("GPUSWARM_NODE_ENDPOINTS", "5.6.7.8:1, 9.9.9.9:2")
    settings = load(path, host="10.0.0.9", price=None)  # a flag not given (None) does not override
    assert (settings.coordinator, settings.price, settings.host) == ("http://file:1", 3.5, "10.0.0.9")
    assert settings.endpoints == ["5.6.7.8:1", "9.9.9.9:2"]
    assert settings.state_dir == NodeSettings.model_fields["state_dir"].default  # nowhere set: the default


@pytest.mark.parametrize("content", ["pricee = 1.0\n", "price = -1\n", "listen_port = 70000\n",
                                     'log_level = "loud"\n'])
def test_a_mistake_in_the_file_is_refused(tmp_path, content):
    path = tmp_path / "node.toml"
    path.write_text(content)
    with pytest.raises(ValidationError):
        load(path)


def test_the_file_rendered_by_init_reads_back_as_what_was_given(tmp_path):
    text = render_toml({"coordinator": "http://10.0.0.1:8470", "price": 1.25, "state_dir": Path("/var/lib/x")})
    assert set(tomllib.loads(text)) == {"coordinator", "price", "state_dir"}  # the rest: commented defaults
    for name, field in NodeSettings.model_fields.items():
        assert f"# {field.description}" in text and (f"# {name} =" in text or f"\n{name} = " in text)
    path = tmp_path / "node.toml"
    path.write_text(text)
    settings = load(path)
    assert (settings.coordinator, settings.price, settings.state_dir) == ("http://10.0.0.1:8470", 1.25,
                                                                        Path("/var/lib/x"))
    # Uncommenting every default gives a valid file too.
    path.write_text("\n".join(line[2:] if line.startswith("# ") and " = " in line else line
                              for line in text.splitlines()))
    assert load(path).model_dump() == load(None, coordinator="http://10.0.0.1:8470", price=1.25,
                                           state_dir=Path("/var/lib/x")).model_dump()


def test_a_named_config_must_exist(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError):
        config_file(tmp_path / "missing.toml")
    monkeypatch.setenv("GPUSWARM_NODE_CONFIG", str(tmp_path / "also-missing.toml"))
    with pytest.raises(FileNotFoundError):
        config_file(None)


def test_node_init_writes_the_file_once_and_start_refuses_a_bad_one(tmp_path):
    path = tmp_path / "etc" / "node.toml"
    result = gpuswarm("node", "init", str(path), "--coordinator", "http://10.0.0.1:8470", "--price", "0.8")
    assert result.returncode == 0, result.stderr
    assert tomllib.loads(path.read_text()) == {"coordinator": "http://10.0.0.1:8470", "price": 0.8}
    again = gpuswarm("node", "init", str(path))
    assert again.returncode == 1 and "exists; --force replaces it" in again.stderr
    assert gpuswarm("node", "init", str(path), "--force").returncode == 0
    assert gpuswarm("node", "init", str(tmp_path / "x.toml"), "--price", "-1").returncode == 2

    path.write_text("price = 'free'\n")
    bad = gpuswarm("node", "start", "--config", str(path))
    assert bad.returncode == 2 and "node config: price:" in bad.stderr
    missing = gpuswarm("node", "start", "--config", str(tmp_path / "none.toml"))
    assert missing.returncode == 2 and "no node config at" in missing.stderr
