"""Resolving model and GPU names: catalog hub ids and aliases, config.json files and folders, the local HF
cache, custom GPU sizes, and the one-line errors for everything else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vramledger.analytic.params import count_params
from vramledger.catalog import catalog_entry, gpu_entries, model_entries, resolve_gpu, resolve_model, variant_note
from vramledger.errors import VramledgerError

# Qwen2.5-0.5B's config.json fields that decide its shape; 494,032,768 parameters published.
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("meta-llama/Llama-3.1-8B", "llama-3.1-8b"),
        ("META-LLAMA/LLAMA-3.1-8B", "llama-3.1-8b"),
        ("llama-3.1-8b", "llama-3.1-8b"),
        ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"),
        ("meta-llama/Meta-Llama-3-8B", "llama-3-8b"),
        ("Qwen/Qwen2.5-7B", "qwen2.5-7b"),
        ("qwen2.5-7b", "qwen2.5-7b"),
        ("Qwen2.5-7B-Instruct", "qwen2.5-7b"),
        ("Qwen/Qwen3-30B-A3B", "qwen3-30b-a3b"),
        ("mixtral", "mixtral-8x7b"),
        ("gemma_2_9b", "gemma-2-9b"),
        ("  google/gemma-3-1b-it ", "gemma-3-1b"),
        ("microsoft/Phi-3-mini-4k-instruct", "phi-3-mini-4k"),
        ("gpt2", "gpt2"),
    ],
)
def test_names_resolve_case_insensitively(name: str, key: str) -> None:
    spec = resolve_model(name)
    # A variant (an instruct tune) keeps the name the user gave; the config it is sized with is the entry's.
    assert (spec.config_name or spec.name) == model_entries()[key].hub_id
    assert spec.name in (name.strip(), model_entries()[key].hub_id)
    assert catalog_entry(name).key == key


@pytest.mark.parametrize(
    ("name", "hub_id"),
    [
        ("Qwen/Qwen3-4B-Instruct-2507", "Qwen/Qwen3-4B"),  # dated re-release of an instruct tune
        ("NousResearch/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-8B"),  # a mirror under another organisation
        ("unsloth/Qwen3-4B-Instruct-2507-bnb-4bit", "Qwen/Qwen3-4B"),  # a quantised mirror
        ("qwen2_5_7b_instruct", "Qwen/Qwen2.5-7B"),  # torchtune's builder, models/qwen2_5/_model_builders.py
        ("llama3_1_8b", "meta-llama/Llama-3.1-8B"),  # torchtune models/llama3_1/_model_builders.py
        ("qwen2_5_0_5b", "Qwen/Qwen2.5-0.5B"),
        ("gemma2_2b", "google/gemma-2-2b"),
    ],
)
def test_variants_and_mirrors_resolve_by_pattern_and_keep_their_name(name: str, hub_id: str) -> None:
    spec = resolve_model(name)
    assert spec.name == name  # never renamed to the stand-in
    assert spec.config_name == hub_id
    note = variant_note(spec)
    assert note is not None and name in note and hub_id in note


def test_the_catalog_model_itself_carries_no_note() -> None:
    spec = resolve_model("meta-llama/Meta-Llama-3-8B")
    assert spec.config_name == "" and variant_note(spec) is None


def test_unknown_name_suggests_a_catalog_stand_in() -> None:
    with pytest.raises(VramledgerError, match=r"vramledger estimate <catalog-name> --config FILE"):
        resolve_model("acme/TotallyNew-13B")


def test_hf_cache_snapshot_is_named_by_its_repo_id(tmp_path: Path) -> None:
    # huggingface_hub's cache layout: models--{org}--{name}/snapshots/{commit hash}/config.json
    snap = tmp_path / "models--acme--Tiny-1B" / "snapshots" / ("0123abcd" * 5)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(QWEN25_05B))
    assert resolve_model(str(snap / "config.json")).name == "acme/Tiny-1B"


def test_every_alias_names_its_own_entry() -> None:
    # An alias claimed by two files would silently resolve to one of them.
    for key, entry in model_entries().items():
        for name in (key, entry.hub_id, *entry.aliases):
            found = catalog_entry(name)
            assert found is not None and found.key == key, (name, key, found and found.key)
        assert all(a == a.lower() for a in entry.aliases), key


def test_unknown_name_lists_close_matches() -> None:
    close = r"'llama-3.1-9b' is not in the catalog.*did you mean.*llama-3\.1-8b"
    with pytest.raises(VramledgerError, match=close):
        resolve_model("llama-3.1-9b")
    with pytest.raises(VramledgerError, match="not in the catalog or the local HF cache"):
        resolve_model("zzzz-unknown-model")
    with pytest.raises(VramledgerError, match="empty name"):
        resolve_model("  ")


def test_config_file_and_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_05B))
    by_file = resolve_model(str(tmp_path / "config.json"))
    by_dir = resolve_model(str(tmp_path))
    assert count_params(by_file) == count_params(by_dir) == 494_032_768
    assert by_file.source == str(tmp_path / "config.json")


def test_local_hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snap = tmp_path / "models--acme--tiny-qwen" / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps(QWEN25_05B))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert count_params(resolve_model("acme/tiny-qwen")) == 494_032_768


def test_missing_config_in_directory(tmp_path: Path) -> None:
    with pytest.raises(VramledgerError, match="no config.json at"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "is not valid JSON"),
        ("[1, 2, 3]", "expected a JSON object"),
        (json.dumps({**QWEN25_05B, "hidden_size": None}), "missing 'hidden_size'"),
        (json.dumps({**QWEN25_05B, "num_hidden_layers": "24"}), "'num_hidden_layers' must be an integer"),
        (json.dumps({**QWEN25_05B, "num_key_value_heads": 3}), "must divide num_attention_heads"),
    ],
    ids=["syntax", "not-an-object", "missing-field", "string-field", "bad-gqa"],
)
def test_malformed_config_is_one_clear_error(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(VramledgerError, match=message):
        resolve_model(str(path))


def test_remote_code_model_type_is_refused_with_the_reason(tmp_path: Path) -> None:
    # Kimi-K2's config.json (moonshotai/Kimi-K2-Instruct) names its own Python files; we never run them.
    path = tmp_path / "config.json"
    remote = {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    }
    path.write_text(json.dumps({**QWEN25_05B, "model_type": "kimi_k2", "auto_map": remote}))
    with pytest.raises(
        VramledgerError,
        match=r"model_type 'kimi_k2' cannot be built: it needs the repository's "
        r"own Python code \(auto_map: AutoConfig, AutoModelForCausalLM\), which vramledger never runs",
    ):
        resolve_model(str(path))


def test_model_type_unknown_to_transformers(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**QWEN25_05B, "model_type": "not_a_model"}))
    with pytest.raises(
        VramledgerError,
        match=r"model_type 'not_a_model' cannot be built: transformers .* does not "
        r"know it; .*vramledger estimate <catalog-name> --config FILE",
    ):
        resolve_model(str(path))


def test_a_config_file_is_named_by_its_file_or_its_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without ``_name_or_path``: a file named for its model by its stem, a config.json by its folder, also when the
    path is relative (the folder of ``config.json`` is then ``.``, whose name is empty)."""
    (tmp_path / "acme-small.json").write_text(json.dumps(QWEN25_05B))
    (tmp_path / "acme-tiny").mkdir()
    (tmp_path / "acme-tiny" / "config.json").write_text(json.dumps(QWEN25_05B))
    monkeypatch.chdir(tmp_path)
    assert resolve_model("acme-small.json").name == "acme-small"
    monkeypatch.chdir(tmp_path / "acme-tiny")
    assert resolve_model("config.json").name == "acme-tiny"


def test_a_config_json_written_by_transformers_with_an_infinite_float(tmp_path: Path) -> None:
    """transformers 5 writes inf as ``{"__float__": "Infinity"}`` (Bamba's default ``time_step_limit`` is
    ``(0.0, inf)``) and reads it back as a float; so do we: the model builds, and counts what transformers' own
    meta-device build of the same config holds."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    small = {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "mamba_n_heads": 8,
        "mamba_d_head": 64,
        "attn_layer_indices": [1],
    }
    cfg = transformers.BambaConfig(**small)
    path = tmp_path / "config.json"
    cfg.to_json_file(str(path))
    assert '"__float__": "Infinity"' in path.read_text()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert count_params(resolve_model(str(path))) == sum(p.numel() for p in model.parameters())


def test_a_field_transformers_validates_is_one_line_naming_it(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**QWEN25_05B, "model_type": "bamba", "time_step_limit": [0.0, "inf"]}))
    with pytest.raises(
        VramledgerError,
        match=r"transformers rejected the config \(Validation error for field "
        r"'time_step_limit'[^\n]*; fix the named field$",
    ):
        resolve_model(str(path))


# --- GPUs ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("4090", "rtx-4090"),
        ("RTX-4090", "rtx-4090"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("h100", "h100-sxm"),
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("H100-PCIe", "h100-pcie"),
        ("a100", "a100-80gb"),
        ("a100-40gb", "a100-40gb"),
        ("Tesla T4", "t4"),
        ("a10g", "a10g"),
        ("MI300X", "mi300x"),
    ],
)
def test_gpus_resolve_by_key_name_and_alias(name: str, key: str) -> None:
    assert resolve_gpu(name).key == key


def test_gpu_catalog_facts() -> None:
    gpus = gpu_entries()
    assert len(gpus) >= 20
    # torch.cuda.get_device_properties(0).total_memory on these two, as published.
    assert gpus["h100-sxm"].memory_bytes == 85_024_112_640
    assert gpus["rtx-4090"].memory_bytes == 25_386_352_640
    # Volta and Turing tensor cores have no bf16 (CUDA compute capability 7.x).
    assert {k for k, g in gpus.items() if not g.supports_bf16} == {"v100-16gb", "v100-32gb", "t4"}
    for key, g in gpus.items():
        assert g.bf16_tflops > 0 and g.memory_bandwidth_gbs > 0 and g.host_link_gbs in (16, 32, 64), key
        assert g.vendor in ("nvidia", "amd") and g.arch and g.source, key


def test_gpu_aliases_are_unique() -> None:
    raw = json.loads((Path(__file__).parents[2] / "src/vramledger/catalog/gpus.json").read_text())
    seen: dict[str, str] = {}
    for item in raw["gpus"]:
        for name in {item["key"], item["name"].lower(), *(a.lower() for a in item["aliases"])}:
            assert seen.setdefault(name, item["key"]) == item["key"], name


def test_custom_gpu_sizes() -> None:
    gpu = resolve_gpu("24GiB")
    assert gpu.key == "custom" and gpu.memory_bytes == 24 * 2**30
    assert resolve_gpu("80GB").memory_bytes == 80 * 10**9
    named = resolve_gpu("my-card:16GiB")
    assert named.name == "my-card" and named.memory_bytes == 16 * 2**30


def test_a_size_of_nothing_is_refused_naming_the_flag() -> None:
    # "0GiB" parses as a size; a card with no memory used to pass through to GPUSpec's check, whose message named
    # neither the flag nor the fix.
    for text in ("0GiB", "card:0GB"):
        with pytest.raises(VramledgerError, match=r"^gpu: '.*' is no memory; give the card's size, e.g. --gpu 24GiB$"):
            resolve_gpu(text)


def test_unknown_gpu_lists_close_matches() -> None:
    with pytest.raises(VramledgerError, match=r"gpu: 'h10' is not in the catalog; did you mean .*h100"):
        resolve_gpu("h10")
