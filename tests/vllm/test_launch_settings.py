"""The real-vLLM launcher's pure parts: engine arguments from the cluster config, model dir."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from schemas.cluster import ClusterConfig
from switchyard import vllm_model, vllm_servers


def test_shipped_cluster_gives_two_different_servers() -> None:
    cluster = ClusterConfig.from_file(vllm_servers.DEFAULT_CLUSTER)
    shape = vllm_model.ModelShape()
    specs = {m.name: m for m in cluster.models}
    insts = vllm_servers.local_instances(cluster)
    assert len(insts) >= 2
    settings = [vllm_servers.ServerSettings.of(i, specs[i.model], shape) for i in insts]
    assert len({(s.max_model_len, s.max_num_seqs, s.prefix_caching) for s in settings}) == 2
    wide = settings[0]
    # 16384 blocks x 16 tokens x 4 KiB per token = exactly 1 GiB
    assert shape.kv_bytes_per_token() == 4096 and wide.kv_cache_gib == 1
    args = wide.args(Path("/m"), 18000)
    assert args[args.index("--max-model-len") + 1] == "2048"
    assert args[args.index("--block-size") + 1] == "128"  # the config's, not the device default
    assert "--enforce-eager" in args and "--enable-prefix-caching" in args
    assert "--enable-prompt-tokens-details" in args  # the usage chunk's cached_tokens
    narrow_args = settings[1].args(Path("/m"), 18001)
    assert "--no-enable-prefix-caching" in narrow_args


def test_model_dir_is_deterministic(tmp_path: Path) -> None:
    shape = vllm_model.ModelShape()
    assert 16_000_000 < shape.parameters() < 17_000_000
    a = vllm_model.make_model_dir(shape, tmp_path / "a")
    b = vllm_model.make_model_dir(shape, tmp_path / "b")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    tok = json.loads((a / "tokenizer.json").read_text())
    assert len(tok["model"]["vocab"]) <= cfg["vocab_size"]
    tcfg = json.loads((a / "tokenizer_config.json").read_text())
    assert tcfg["eos_token"] == "<|im_end|>" and "<|im_start|>" in tcfg["chat_template"]


def test_servers_started_together_get_their_own_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    # vLLM's "auto" would pin both engines to the same core of the node
    assert vllm_servers.cpu_binds(2, [0, 1]) == ["0", "1"]
    assert vllm_servers.cpu_binds(2, [3, 2, 5, 4]) == ["2,3", "4,5"]
    assert vllm_servers.cpu_binds(3, [0, 1]) == ["0", "1", "0"]
    assert vllm_servers.cpu_binds(1, [0, 1]) == [None]  # a lone server: vLLM's own choice


def test_a_users_bind_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3|4-7")
    assert vllm_servers.cpu_binds(2, [0, 1]) == [None, None]
