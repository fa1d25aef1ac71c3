"""Hub names (org/name, org/name:QUANT) resolved through huggingface_hub, offline, from a cache laid out as
huggingface_hub writes it (its own folder naming and symlinking): a tiny model folder, and a repository of two
GGUFs. No network; nothing stands in for huggingface_hub but the cache folder."""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.cli import main
from tokenmill.executor.loader import default_model_path, resolve_model_path
from tokenmill.executor.loader.hub import resolve_hub_name
from tokenmill.server.app import default_model_name

COMMIT = "0123456789abcdef0123456789abcdef01234567"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def cache_repo(cache: Path, repo: str, files: dict[str, Path]) -> Path:
    """Files into the hub cache as a download leaves them: blobs named by their hash, the snapshot's files linked
    to them, refs/main naming the commit. Returns the snapshot folder."""
    from huggingface_hub.file_download import _create_symlink, repo_folder_name
    root = cache / repo_folder_name(repo_id=repo, repo_type="model")
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    snapshot = root / "snapshots" / COMMIT
    for name, src in files.items():
        data = src.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        _create_symlink(str(blob), str(snapshot / name), new_blob=False)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_llama) -> Path:
    cache = tmp_path / "hub"
    folder = Path(tiny_llama[0])
    cache_repo(cache, "tokenmill-test/tiny-llama", {f.name: f for f in folder.iterdir() if f.is_file()})
    gguf = Path(default_model_path())
    cache_repo(cache, "tokenmill-test/smol-GGUF", {"smol-Q4_1.gguf": gguf, "smol-Q8_0.gguf": gguf,
                                                   "README.md": Path(__file__)})
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_hub_name_loads_from_the_cache_offline(hub_cache: Path, tiny_llama) -> None:
    """org/name gives the same model as its folder, and the server names it org/name."""
    path = resolve_model_path("tokenmill-test/tiny-llama")
    assert Path(path).parent.name == "snapshots" or COMMIT in path
    assert default_model_name(path) == "tokenmill-test/tiny-llama"
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}]
    by_name = LLM("tokenmill-test/tiny-llama", dtype="float32", kv_cache_memory_gb=0.02)
    by_path = LLM(tiny_llama[0], dtype="float32", kv_cache_memory_gb=0.02)
    assert [o.outputs[0].token_ids for o in by_name.generate(prompts, GREEDY, use_tqdm=False)] == \
        [o.outputs[0].token_ids for o in by_path.generate(prompts, GREEDY, use_tqdm=False)]
    # a revision the cache has, by its commit
    assert resolve_hub_name("tokenmill-test/tiny-llama", revision=COMMIT) == path


def test_a_quantisation_picks_one_gguf(hub_cache: Path, capsys: pytest.CaptureFixture) -> None:
    path = resolve_model_path("tokenmill-test/smol-GGUF:q4_1")
    assert path.endswith("smol-Q4_1.gguf")
    assert default_model_name(path) == "tokenmill-test/smol-GGUF"
    with pytest.raises(ValueError, match=r"no GGUF file matching 'Q5_K_M'; the GGUF files there: smol-Q4_1.gguf, "
                                         r"smol-Q8_0.gguf"):
        resolve_model_path("tokenmill-test/smol-GGUF:Q5_K_M")
    with pytest.raises(ValueError, match=r"holds 2 GGUF files; name one by its quantisation, as "
                                         r"tokenmill-test/smol-GGUF:Q4_K_M"):
        resolve_model_path("tokenmill-test/smol-GGUF")
    assert main(["download", "tokenmill-test/smol-GGUF:Q8_0"]) == 0       # offline: what the cache holds
    assert capsys.readouterr().out.strip().endswith("smol-Q8_0.gguf")
    # or by its file name (transformers' gguf_file, llama-server's -hff), through the engine's option too
    assert resolve_model_path("tokenmill-test/smol-GGUF", gguf_file="smol-Q8_0.gguf").endswith("smol-Q8_0.gguf")
    assert main(["download", "tokenmill-test/smol-GGUF", "--gguf-file", "smol-Q4_1.gguf"]) == 0
    assert capsys.readouterr().out.strip().endswith("smol-Q4_1.gguf")
    with pytest.raises(ValueError, match=r"has no GGUF file 'smol-Q2_K.gguf'; the GGUF files there: smol-Q4_1.gguf, "
                                         r"smol-Q8_0.gguf"):
        resolve_model_path("tokenmill-test/smol-GGUF", gguf_file="smol-Q2_K.gguf")
    with pytest.raises(ValueError, match="both pick a GGUF"):
        resolve_model_path("tokenmill-test/smol-GGUF:Q8_0", gguf_file="smol-Q8_0.gguf")
    from tokenmill.cli import build_parser, engine_kwargs
    args = build_parser().parse_args(["serve", "-hf", "tokenmill-test/smol-GGUF", "-hff", "smol-Q8_0.gguf"])
    assert engine_kwargs(args)["gguf_file"] == "smol-Q8_0.gguf"


def test_what_fails_says_what_to_do(hub_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ValueError, match=r"tokenmill-test/absent is not in .* and HF_HUB_OFFLINE is set: fetch it "
                                         r"once with a network \(`tokenmill download tokenmill-test/absent`\)"):
        resolve_model_path("tokenmill-test/absent")
    with pytest.raises(ValueError, match="at revision 'v2' is not in"):
        resolve_model_path("tokenmill-test/tiny-llama", revision="v2")
    with pytest.raises(ValueError, match=r"does not exist; pass a Hugging Face folder .* or a hub name"):
        resolve_model_path("not a/hub name!")
    local = tmp_path / "cwd" / "tokenmill-test" / "tiny-llama"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "cwd")
    with pytest.raises(ValueError, match=r"both a local path and a model in the Hugging Face cache; write "
                                         r"\./tokenmill-test/tiny-llama"):
        resolve_model_path("tokenmill-test/tiny-llama")
    assert main(["download", "tokenmill-test/absent"]) == 2
    assert "HF_HUB_OFFLINE is set" in capsys.readouterr().err
    shutil.rmtree(local.parent)
