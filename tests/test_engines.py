"""kvcal.engines: the serving and lm_eval commands of each configuration, the refusals, and the lm_eval command
parsed by lm-eval's own CLI parser."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml

from kvcal.engines import (
    KV_CACHE_DTYPES,
    OTHER_BACKEND,
    EngineSetup,
    commands_dict,
    engine_commands,
    group_setups,
    markdown_section,
    setup_from_run_dir,
)
from kvcal.formats import FORMATS
from kvcal.rundir import RunConfig


def _by_engine(setup: EngineSetup) -> dict[str, dict]:
    return commands_dict(setup)


def _lm_eval_args(argv: list[str]):  # noqa: ANN202 - lm-eval's argparse Namespace
    """lm-eval 0.4.13's own parser (`lm_eval run ...`) on the command kvcal prints."""
    from lm_eval._cli.harness import HarnessCLI

    assert argv[0] == "lm_eval"
    return HarnessCLI()._parser.parse_args(["run", *argv[1:]])


def test_every_engine_name_in_the_format_table_is_an_engine_choice() -> None:
    for fmt in FORMATS.values():
        for engine, names in KV_CACHE_DTYPES.items():
            name = fmt.engine_names.get(engine)
            if engine == "trtllm" and name is not None:
                name = (
                    name.lower()
                )  # kv_cache_config.dtype is lower case; the table keeps TensorRT-LLM's FP8/NVFP4
            assert name is None or name in names or (engine, name) in OTHER_BACKEND, (fmt.name, engine, name)
            if name is not None and (engine, name) in OTHER_BACKEND:  # refused with the reason, no command
                (cmd,) = [c for c in engine_commands(EngineSetup("ckpt", fmt.name)) if c.engine == engine]
                assert cmd.refused == OTHER_BACKEND[engine, name]


def test_calibrated_fp8_with_skip_layers() -> None:
    s = EngineSetup(
        "ckpt", "fp8_e4m3", scales_path="runs/scales/a.safetensors", granularity="tensor", skip_layers=(0, 3),
        tasks=("kl", "gsm8k"), num_fewshot=5, limit=50, max_gen_toks=256, label="fp8-cal",
    )  # fmt: skip
    d = _by_engine(s)
    v = d["vllm"]
    assert v["export_argv"] == [
        "kvcal", "export", "runs/scales/a.safetensors", "ckpt", "--to", "vllm", "-o", "runs/scales/a-vllm"
    ]  # fmt: skip
    # the exported checkpoint carries the scales; skip layers as vLLM's list option; attention in the model dtype
    assert v["serve_argv"] == [
        "vllm", "serve", "runs/scales/a-vllm", "--kv-cache-dtype", "fp8", "--kv-cache-dtype-skip-layers", "0", "3",
        "--attention-backend", "TRITON_ATTN",
    ]  # fmt: skip
    args = _lm_eval_args(v["lm_eval_argv"])
    assert args.model == "vllm"
    assert args.model_args == {
        "pretrained": "runs/scales/a-vllm",
        "kv_cache_dtype": "fp8",
        "kv_cache_dtype_skip_layers": ["0", "3"],
        "attention_backend": "TRITON_ATTN",
    }
    assert args.tasks == ["gsm8k"]  # kl is kvcal's own task: noted, not passed
    assert args.num_fewshot == 5 and args.limit == 50 and args.log_samples is True
    assert args.gen_kwargs == {"max_gen_toks": 256}
    assert args.output_path == "lm-eval/vllm-fp8-cal"
    assert any("kl" in n for n in v["notes"])
    assert shlex.split(v["lm_eval"]) == v["lm_eval_argv"]  # the printed line is the argument list
    # SGLang cannot keep layers out of KV quantization; TRT-LLM loads no kvcal scales
    assert "skip" in d["sglang"]["refused"] and "serve" not in d["sglang"]
    assert "ModelOpt" in d["trtllm"]["refused"]


def test_sglang_scale_file_and_lm_eval() -> None:
    s = EngineSetup("ckpt", "fp8_e4m3", scales_path="s/x.safetensors", granularity="tensor", tasks=("gsm8k",))
    g = _by_engine(s)["sglang"]
    assert g["export_argv"][-3:] == ["sglang", "-o", "s/x-sglang.json"]
    assert g["serve_argv"] == [
        "python", "-m", "sglang.launch_server", "--model-path", "ckpt", "--kv-cache-dtype", "fp8_e4m3",
        "--quantization-param-path", "s/x-sglang.json",
    ]  # fmt: skip
    args = _lm_eval_args(g["lm_eval_argv"])
    assert args.model == "sglang"
    assert args.model_args == {
        "pretrained": "ckpt",
        "kv_cache_dtype": "fp8_e4m3",
        "quantization_param_path": "s/x-sglang.json",
    }


@pytest.mark.parametrize(
    ("setup", "engine", "reason"),
    [
        (EngineSetup("m", "fp4_e2m1"), "vllm", "no KV cache dtype for fp4_e2m1"),
        (EngineSetup("m", "mxfp4"), "sglang", "no KV cache dtype for mxfp4"),
        (EngineSetup("m", "int8_per_token_head"), "trtllm", "no KV cache dtype"),
        (EngineSetup("m", "k=fp8_e4m3,v=nvfp4"), "vllm", "two formats"),
        (EngineSetup("m", "nvfp4", nvfp4_global="per_sequence"), "vllm", "per-sequence"),
        (EngineSetup("m", "fp8_e4m3", scales_path="a.safetensors", granularity="head"), "sglang", "per-head"),
        (
            EngineSetup("m", "nvfp4", scales_path="a.safetensors", granularity="tensor"),
            "vllm",
            "no checkpoint",
        ),
        (EngineSetup("m", "fp8_e4m3", first_batch=True), "vllm", "--calculate-kv-scales"),
        (EngineSetup("m", "fp8_e4m3", attention="fp8"), "sglang", "FlashAttention-3"),
        (EngineSetup("m", "fp8_e4m3", prefix_serde="fp8"), "vllm", "LMCache's storage tier"),
        (EngineSetup("m", "bf16", prefix_serde="aesgcm"), "sglang", "LMCache's storage tier"),
    ],
)
def test_refusals(setup: EngineSetup, engine: str, reason: str) -> None:
    d = _by_engine(setup)[engine]
    assert reason in d["refused"]
    assert not {"serve", "lm_eval", "export"} & set(d)


def test_per_head_scales_and_fp8_attention_pick_flash_attn() -> None:
    head = _by_engine(EngineSetup("m", "fp8_e4m3", scales_path="a.safetensors", granularity="head"))["vllm"]
    assert head["serve_argv"][-2:] == ["--attention-backend", "FLASH_ATTN"]
    fa3 = _by_engine(EngineSetup("m", "fp8_e4m3", attention="fp8"))["vllm"]
    assert fa3["serve_argv"][-2:] == ["--attention-backend", "FLASH_ATTN"]
    nv = _by_engine(EngineSetup("m", "nvfp4", tasks=("gsm8k",)))
    assert nv["vllm"]["serve_argv"] == ["vllm", "serve", "m", "--kv-cache-dtype", "nvfp4"]
    assert nv["trtllm"]["files"] == {"kv_cache.yaml": "kv_cache_config:\n  dtype: nvfp4\n"}
    args = _lm_eval_args(nv["trtllm"]["lm_eval_argv"])
    assert args.model == "local-completions" and args.model_args["base_url"].endswith("/v1/completions")


def test_baseline_and_kl_only() -> None:
    d = _by_engine(EngineSetup("m", "bf16", tasks=("kl",)))
    assert d["vllm"]["serve_argv"] == ["vllm", "serve", "m", "--kv-cache-dtype", "bfloat16"]
    assert d["sglang"]["serve_argv"][-2:] == ["--kv-cache-dtype", "bf16"]
    assert "lm_eval" not in d["vllm"]  # no lm-eval task to run


def test_from_run_dir_groups_tasks_and_renders(tmp_path) -> None:  # noqa: ANN001
    for task in ("gsm8k", "gpqa_diamond_zeroshot"):
        d = tmp_path / task / "cfg"
        d.mkdir(parents=True)
        rc = RunConfig(model="m", model_dir="/ckpt", kv_format="fp8_e4m3", tasks=[task], num_fewshot=0,
                       skip_layer_indices=[1], dtype="bfloat16")  # fmt: skip
        (d / "config.yaml").write_text(yaml.safe_dump(rc.to_dict()))
    named = [("cfg", setup_from_run_dir(tmp_path / t / "cfg")) for t in ("gsm8k", "gpqa_diamond_zeroshot")]
    (label, setup), = group_setups(named)  # fmt: skip
    assert label == "cfg" and setup.tasks == ("gsm8k", "gpqa_diamond_zeroshot")
    vllm = engine_commands(setup)[0]
    args = _lm_eval_args(list(vllm.lm_eval))
    assert args.tasks == ["gsm8k,gpqa_diamond_zeroshot"] or args.tasks == ["gsm8k", "gpqa_diamond_zeroshot"]
    assert args.model_args["dtype"] == "bfloat16" and args.model_args["kv_cache_dtype_skip_layers"] == ["1"]
    assert vllm.serve[3:5] == ("--dtype", "bfloat16")  # the engine computes in the run's model dtype
    md = markdown_section(named)
    assert md.startswith("## Engine commands") and "### cfg" in md and "vllm serve: vllm serve /ckpt" in md
    assert setup_from_run_dir(tmp_path / "missing") is None
    json.dumps(commands_dict(setup))  # JSON-ready (release.json, sweep.json)


DOCS = [{"text": "t5 t6 t7 t8 t9 t10 t11 t12"}, {"text": "t20 t21 t22 t23 t24 t25"}]


@pytest.mark.slow  # four lm-eval runs end to end
def test_eval_and_compare_print_and_record_the_commands(
    tmp_path,
    word_llama_dir,
    lm_eval_task,
    invoke,  # noqa: ANN001 - fixtures
) -> None:
    lm_eval_task(tmp_path / "tasks", "roll", "loglikelihood_rolling", DOCS, ["word_perplexity"])
    common = ["--tasks", "roll", "--include-path", str(tmp_path / "tasks"), "--skip-layers", "1"]
    code, out, err = invoke(
        ["eval", str(word_llama_dir), "-f", "bf16", *common[:4], "-o", str(tmp_path / "bf16")]
    )
    assert code == 0, err
    code, out, err = invoke(
        ["eval", str(word_llama_dir), "-f", "fp8_e4m3", *common, "-o", str(tmp_path / "fp8")]
    )
    assert code == 0, err
    assert "engine commands for fp8:" in out
    # the run's resolved model dtype (the checkpoint's) is what the engine is told to compute in
    dtype = yaml.safe_load((tmp_path / "fp8" / "config.yaml").read_text())["dtype"]
    assert (
        f"vllm serve: vllm serve {word_llama_dir} --dtype {dtype} --kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 1 "
        "--attention-backend TRITON_ATTN" in out
    )
    assert "sglang: cannot run this configuration: SGLang has no option to keep layers out" in out
    lm_line = next(ln.strip() for ln in out.splitlines() if ln.strip().startswith("vllm lm-eval: "))
    args = _lm_eval_args(shlex.split(lm_line.removeprefix("vllm lm-eval: ")))
    assert args.tasks in (["roll"],) and args.include_path == str(tmp_path / "tasks") and args.log_samples
    report = tmp_path / "report.md"
    code, out, err = invoke(["compare", str(tmp_path / "bf16"), str(tmp_path / "fp8"), "--baseline", "bf16",
                             "-o", str(report), "--json", "--bootstrap", "200"])  # fmt: skip
    assert code == 0, err
    md = report.read_text()
    assert "## Engine commands" in md and "### fp8" in md and "### bf16" in md
    ec = json.loads(out)["engine_commands"]
    assert ec["fp8"]["vllm"]["serve_argv"][-4:] == ["--kv-cache-dtype-skip-layers", "1", "--attention-backend",
                                                    "TRITON_ATTN"]  # fmt: skip
    assert "refused" in ec["fp8"]["sglang"] and ec["bf16"]["sglang"]["serve_argv"][-1] == "bf16"


def _kvcal_lm_eval_args(argv: list[str]):  # noqa: ANN202 - lm-eval's argparse Namespace
    """The printed `kvcal-lm-eval` command: kvcal's own options split off, the rest parsed by lm-eval's parser."""
    from kvcal.evaluate.lm_eval_cli import engine_of, split_argv

    assert argv[0] == "kvcal-lm-eval" and engine_of(argv[1:]) == "vllm"
    data, rest = split_argv(argv[1:])
    return data, _lm_eval_args(["lm_eval", *rest])


def test_vllm_cpu_build_commands_run_on_the_cpu_build() -> None:
    """vLLM's CPU build: no GPU-only attention backend, the run's dtype and window, kvcal-lm-eval (lm-eval's own
    --model vllm cannot start the CPU build), the offline data, a server on 127.0.0.1."""
    s = EngineSetup("ckpt", "fp8_e4m3", dtype="bfloat16", tasks=("wikitext", "kl"), limit=20, max_length=8192,
                    data_dir="../shared/data", label="fp8")  # fmt: skip
    cpu = _by_engine(s)["vllm-cpu"]
    assert cpu["serve_argv"] == ["vllm", "serve", "ckpt", "--dtype", "bfloat16", "--kv-cache-dtype", "fp8",
                                 "--enforce-eager", "--max-model-len", "8192", "--kv-cache-memory-bytes",
                                 str(4 * 2**30), "--host", "127.0.0.1"]  # fmt: skip  # no config: the 4 GiB fallback
    assert "--attention-backend" not in cpu["serve_argv"] and "attention_backend" not in cpu["lm_eval"]
    data, args = _kvcal_lm_eval_args(cpu["lm_eval_argv"])
    assert data.data_dir == "../shared/data" and args.model == "vllm" and args.tasks == ["wikitext"]
    assert args.model_args == {"pretrained": "ckpt", "kv_cache_dtype": "fp8", "dtype": "bfloat16",
                               "enforce_eager": True, "max_model_len": 8192,
                               "kv_cache_memory_bytes": 4 * 2**30}  # fmt: skip
    assert any("AVX-512" in n for n in cpu["notes"])
    # the GPU line keeps its backend (Hopper's default FA3 would quantize Q too) and gets the window as well
    gpu = _by_engine(s)["vllm"]
    assert "TRITON_ATTN" in gpu["serve_argv"] and gpu["serve_argv"][-2:] == ["--max-model-len", "8192"]


def test_vllm_cpu_build_refusals_and_warnings() -> None:
    assert "CPU_ATTN" in _by_engine(EngineSetup("ckpt", "nvfp4"))["vllm-cpu"]["refused"]
    assert "CPU_ATTN" in _by_engine(EngineSetup("ckpt", "int8_per_token_head"))["vllm-cpu"]["refused"]
    assert "Hopper" in _by_engine(EngineSetup("ckpt", "fp8_e4m3", attention="fp8"))["vllm-cpu"]["refused"]
    bf16 = _by_engine(EngineSetup("ckpt", "bf16", dtype="bfloat16"))["vllm-cpu"]
    assert bf16["serve_argv"][5:8] == ["--kv-cache-dtype", "auto", "--enforce-eager"]  # CPU_ATTN: no 'bfloat16'
    head = _by_engine(EngineSetup("ckpt", "fp8_e4m3", scales_path="s.safetensors", granularity="head"))
    assert any(n.startswith("WARNING") and "maximum of the per-head" in n for n in head["vllm-cpu"]["notes"])
    f32 = _by_engine(EngineSetup("ckpt", "fp8_e4m3", dtype="float32"))
    assert any("--dtype bfloat16" in n for n in f32["vllm-cpu"]["notes"] + f32["vllm"]["notes"])
    # FP8 at scale 1.0 on the CPU build: its AMX attention loses small V codes (docs/engines.md)
    small = "loses small E4M3 V codes"
    assert any(small in n for n in _by_engine(EngineSetup("ckpt", "fp8_e4m3_cpu"))["vllm-cpu"]["notes"])
    assert not any(small in n for n in head["vllm-cpu"]["notes"])  # calibrated: no warning
    assert not any(small in n for n in _by_engine(EngineSetup("ckpt", "fp8_e5m2_cpu"))["vllm-cpu"]["notes"])


def test_unquantized_run_of_a_checkpoint_with_a_kv_scheme_names_its_cache_dtype(tmp_path: Path) -> None:
    """vLLM serves `--kv-cache-dtype auto` as FP8 on a checkpoint declaring a kv_cache_scheme (kvcal export's):
    the printed BF16 commands of such a checkpoint say bfloat16, on the GPU build and the CPU build alike."""
    ckpt = tmp_path / "ckpt-fp8"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"quantization_config": {"kv_cache_scheme": {"num_bits": 8}}}))
    for fmt in ("auto", "bf16"):
        cmds = _by_engine(EngineSetup(str(ckpt), fmt, dtype="bfloat16", tasks=("wikitext",)))
        for engine in ("vllm", "vllm-cpu"):
            argv = cmds[engine]["serve_argv"]
            assert argv[argv.index("--kv-cache-dtype") + 1] == "bfloat16", (fmt, engine)
            assert '"kv_cache_dtype":"bfloat16"' in shlex.join(cmds[engine]["lm_eval_argv"])
        assert any("serves `auto` on it as FP8" in n for n in cmds["vllm-cpu"]["notes"])
    fp8 = _by_engine(EngineSetup(str(ckpt), "fp8_e4m3", dtype="bfloat16"))["vllm-cpu"]["serve_argv"]
    assert fp8[fp8.index("--kv-cache-dtype") + 1] == "fp8"
    # vLLM raises on fp8_e5m2 over such a checkpoint (measured on vllm-cpu 0.32.0): refused, on the source model not
    for fmt in ("fp8_e5m2", "fp8_e5m2_cpu"):
        e5m2 = _by_engine(EngineSetup(str(ckpt), fmt, dtype="bfloat16", tasks=("wikitext",)))
        assert "not supported with fp8 checkpoints" in e5m2["vllm-cpu"]["refused"], fmt
    assert "not supported with fp8 checkpoints" in _by_engine(EngineSetup(str(ckpt), "fp8_e5m2"))["vllm"]["refused"]
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text("{}")
    argv = _by_engine(EngineSetup(str(plain), "fp8_e5m2_cpu", dtype="bfloat16"))["vllm-cpu"]["serve_argv"]
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8_e5m2"


def test_vllm_cpu_build_cache_is_sized_from_the_checkpoint(tiny_llama_dir: Path) -> None:
    """Without --kv-cache-memory-bytes the CPU build reserves 92% of the machine's memory and refuses to start when
    less is free: the printed command sizes the cache for CPU_KV_SEQUENCES sequences of the window, from the
    checkpoint's own layers, K/V heads and head size."""
    from kvcal.engines import CPU_KV_SEQUENCES
    from kvcal.models.config import load_config
    from kvcal.models.geometry import kv_spec

    kv = kv_spec(load_config(tiny_llama_dir))
    per_token = 2 * 2 * sum(layer.kv_heads * layer.head_dim for layer in kv.layers)
    cpu = _by_engine(EngineSetup(str(tiny_llama_dir), "fp8_e4m3", tasks=("wikitext",), max_length=100))[
        "vllm-cpu"
    ]
    want = -(-CPU_KV_SEQUENCES * 100 * per_token // 2**20) * 2**20
    flag = cpu["serve_argv"].index("--kv-cache-memory-bytes")
    assert (
        cpu["serve_argv"][flag + 1] == str(want)
        and want % 2**20 == 0
        and want >= CPU_KV_SEQUENCES * 100 * per_token
    )
    _, args = _kvcal_lm_eval_args(cpu["lm_eval_argv"])
    assert args.model_args["kv_cache_memory_bytes"] == want
    assert any(
        n.startswith(f"--kv-cache-memory-bytes {want}: room for 8 sequences of 100 tokens")
        for n in cpu["notes"]
    )
