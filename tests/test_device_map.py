"""Device maps and offload (`--device-map`, `--max-memory`, `--offload-folder`: accelerate's dispatch through
from_pretrained). On CPU for real: half of a tiny model's decoder layers live on disk (weights memory-mapped back
per forward by accelerate's hooks), and calibration and evaluation give what the plain load gives. Bad input: a
device this machine lacks, a memory budget smaller than one layer."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcal.calibrate.run import calibrate
from kvcal.errors import UsageError
from kvcal.models.loading import input_device, load_model
from kvcal.placement import Placement, largest_layer_bytes, parse_max_memory

Invoke = Callable[[list[str]], tuple[int, str, str]]

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = 4


@pytest.fixture(scope="module")
def four_layers(
    tiny_config: Callable[[str], Any], tiny_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A random-weight 4-layer Llama (tiny_config's geometry) with the tiny tokenizer."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config("llama")
    cfg.num_hidden_layers = LAYERS
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("four-layers")
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def _half_on_disk(folder: Path) -> Path:
    """accelerate's explicit map: layers 2 and 3 (half of them) on 'disk', the rest on the CPU."""
    device_map = {
        "model.embed_tokens": "cpu",
        "model.rotary_emb": "cpu",
        "model.norm": "cpu",
        "lm_head": "cpu",
    }
    device_map.update({f"model.layers.{i}": ("disk" if i >= LAYERS // 2 else "cpu") for i in range(LAYERS)})
    path = folder / "half_on_disk.json"
    path.write_text(json.dumps(device_map))
    return path


def test_half_on_disk_is_really_offloaded(four_layers: Path, tmp_path: Path) -> None:
    placement = Placement.parse(str(_half_on_disk(tmp_path)), None, str(tmp_path / "offload"))
    lm = load_model(four_layers, placement=placement)
    assert lm.model.hf_device_map["model.layers.3"] == "disk"
    # an offloaded layer holds no weights of its own; accelerate's hook brings them in per forward
    assert lm.model.model.layers[3].self_attn.k_proj.weight.device.type == "meta"
    assert lm.model.model.layers[0].self_attn.k_proj.weight.device.type == "cpu"
    assert input_device(lm.model) == torch.device("cpu")


@pytest.mark.parametrize(("fmt", "batch_size"), [("fp8_e4m3", 1), ("nvfp4", 3)])
def test_disk_offloaded_scales_equal_the_plain_load(
    fmt: str, batch_size: int, four_layers: Path, tmp_path: Path
) -> None:
    kw: dict[str, Any] = dict(granularity="head", observer="minmax", num_samples=5, seq_len=24)
    plain = calibrate(str(four_layers), fmt, **kw).scale_set
    placed = calibrate(
        str(four_layers), fmt, **kw, batch_size=batch_size,
        device_map=str(_half_on_disk(tmp_path)), offload_folder=str(tmp_path / "offload"),
    ).scale_set  # fmt: skip
    for a, b in zip(plain.k_scales + plain.v_scales, placed.k_scales + placed.v_scales, strict=True):
        assert torch.equal(a, b)
    assert placed.layer_stats == plain.layer_stats
    assert placed.manifest["calibration"]["placement"]["device_map"].endswith("half_on_disk.json")
    assert placed.binding == plain.binding


def test_disk_offloaded_eval_equals_the_plain_load(
    four_layers: Path, tmp_path: Path, lm_eval_task: Callable[..., None]
) -> None:
    from kvcal.evaluate.run import EvalConfig, run_eval
    from kvcal.evaluate.spec import eval_spec

    docs = [{"q": f"the {w} is", "choices": ["red", "blue", "green"], "label": i % 3} for i, w in
            enumerate(["sky", "sea", "leaf", "sun"])]  # fmt: skip
    lm_eval_task(tmp_path / "tasks", "dm_mc", "multiple_choice", docs, ["acc"])
    base: dict[str, Any] = dict(
        model=str(four_layers), kv_format="fp8_e4m3", tasks=["dm_mc", "kl"], include_path=str(tmp_path / "tasks"),
        limit=3, kl_seq_len=16, dtype="float32",
    )  # fmt: skip
    plain = run_eval(eval_spec(EvalConfig(**base, output=str(tmp_path / "plain"))))
    placed = run_eval(eval_spec(
        EvalConfig(
            **base, output=str(tmp_path / "placed"), device_map=str(_half_on_disk(tmp_path)),
            offload_folder=str(tmp_path / "offload"),
        )
    ))  # fmt: skip
    a, b = (json.loads((run / "results.json").read_text())["results"] for run in (plain, placed))
    assert a == b and a["kl"]["kl,none"] > 0
    for task in ("dm_mc", "kl"):
        rows = [(run / f"samples_{task}.jsonl").read_text().splitlines() for run in (plain, placed)]
        strip = [[{k: v for k, v in json.loads(r).items() if k != "arguments"} for r in rs] for rs in rows]
        assert strip[0] == strip[1] and len(strip[0]) == 3


def test_device_map_file_and_max_memory_parse(tmp_path: Path) -> None:
    assert parse_max_memory("0=20GiB, cpu=64GiB") == {0: "20GiB", "cpu": "64GiB"}
    assert parse_max_memory("cuda:1=1GB") == {1: "1GB"}
    with pytest.raises(UsageError, match="'lots' is not a size"):
        parse_max_memory("cpu=lots")
    with pytest.raises(UsageError, match="DEVICE=SIZE"):
        parse_max_memory("64GiB")
    assert Placement.parse("auto").from_pretrained_kwargs() == {"device_map": "auto"}
    assert not Placement.parse(None).active
    with pytest.raises(UsageError, match="add --device-map auto"):
        Placement.parse(None, "cpu=1GiB")
    with pytest.raises(UsageError, match="neither a strategy"):
        Placement.parse(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"model.layers.0": [0]}')
    with pytest.raises(UsageError, match="module 'model.layers.0' has device"):
        Placement.parse(str(bad))
    disk_only = tmp_path / "disk.json"
    disk_only.write_text('{"": "disk"}')
    with pytest.raises(UsageError, match="add --offload-folder"):
        Placement.parse(str(disk_only)).check()


def test_device_the_machine_lacks_is_one_error_line(
    invoke: Invoke, four_layers: Path, tmp_path: Path
) -> None:
    gpus = torch.cuda.device_count()
    path = tmp_path / "map.json"
    path.write_text(json.dumps({"model.embed_tokens": "cpu", "model.layers": gpus + 3, "lm_head": "cpu"}))
    out = tmp_path / "s.safetensors"
    code, _, err = invoke(
        ["calibrate", str(four_layers), "-f", "fp8", "-o", str(out), "--device-map", str(path)]
    )
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and not out.exists()
    assert f"names device 'cuda:{gpus + 3}'" in lines[0] and "module 'model.layers'" in lines[0]
    assert "devices here: cpu" in lines[0]
    code, _, err = invoke(
        ["calibrate", str(four_layers), "-f", "fp8", "-o", str(out), "--device-map", "auto",
         "--max-memory", f"{gpus + 1}=1GiB"]
    )  # fmt: skip
    assert code == 2 and f"--max-memory cuda:{gpus + 1} names device 'cuda:{gpus + 1}'" in err


def test_max_memory_below_one_layer_says_what_one_layer_needs(
    invoke: Invoke, four_layers: Path, tmp_path: Path
) -> None:
    from transformers import AutoConfig

    need, name = largest_layer_bytes(AutoConfig.from_pretrained(four_layers), torch.float32)
    # 4 projections of 64x64 / 64x32 / 64x32 / 64x64, an MLP of 3 x 64x96, two norms of 64: float32 bytes
    assert name == "model.layers.0" and need == 4 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 96 + 2 * 64)
    out = tmp_path / "s.safetensors"
    code, _, err = invoke(
        ["calibrate", str(four_layers), "-f", "fp8", "-o", str(out), "--device-map", "auto",
         "--max-memory", "cpu=10KiB"]
    )  # fmt: skip
    assert code == 2 and not out.exists()
    assert f"'model.layers.0' needs {need / 2**20:.1f} MiB at float32" in err and "cpu=10KiB" in err
    # room for one layer: the check passes and accelerate spreads the rest (here: onto disk)
    res = calibrate(
        str(four_layers), "fp8", num_samples=2, seq_len=16, device_map="auto", max_memory=f"cpu={need * 2 // 1024}KiB",
        offload_folder=str(tmp_path / "off"),
    )  # fmt: skip
    assert res.scale_set.manifest["calibration"]["placement"]["max_memory"] == {
        "cpu": f"{need * 2 // 1024}KiB"
    }
