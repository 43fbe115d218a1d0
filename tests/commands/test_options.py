"""The command line is declared once: shared options read the same in every command, every command's --help
works, and `kvcal eval` builds EvalConfig from its options by name (no field retyped, none forgotten)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, get_args

import pytest
import typer.core
import typer.main

from kvcal.cli import app
from kvcal.commands import calibrate as calibrate_commands
from kvcal.commands import evaluate as eval_commands
from kvcal.commands import options
from kvcal.evaluate.run import EvalConfig

ROOT = typer.main.get_command(app)


# compare.py (kvcal compare / sweep) still declares its own --json help; its owner converts it to JsonOpt.
def _leaf_commands(
    group: typer.core.TyperGroup = ROOT, prefix: tuple[str, ...] = ()
) -> dict[tuple[str, ...], typer.core.TyperCommand]:
    """Every runnable command, e.g. ('eval',), ('models', 'path'), found from the app (new ones included)."""
    out: dict[tuple[str, ...], typer.core.TyperCommand] = {}
    for name, cmd in group.commands.items():
        path = (*prefix, name)
        if isinstance(cmd, typer.core.TyperGroup):
            out |= _leaf_commands(cmd, path)
        else:
            out[path] = cmd
    return out


LEAVES = _leaf_commands()


def _flags_and_help(alias: object) -> tuple[set[str], str]:
    """(flags, help) of a shared option alias like options.DtypeOpt (typer keeps the first flag in `default`)."""
    info = get_args(alias)[1]
    return {info.default, *(info.param_decls or ())}, info.help


def _params_with_flag(flag: str) -> list[tuple[str, Any]]:
    return [
        (" ".join(path), p)
        for path, cmd in LEAVES.items()
        for p in cmd.params
        if flag in getattr(p, "opts", [])
    ]


def test_the_app_has_every_command() -> None:
    names = {" ".join(path) for path in LEAVES}
    assert names == {
        "capacity", "calibrate", "sensitivity", "show", "verify", "drift", "export", "eval", "sweep", "compare",
        "release", "models list", "models install", "models path", "plan", "plan-export", "probe", "formats",
    }  # fmt: skip


@pytest.mark.parametrize("path", sorted(LEAVES), ids=lambda p: "-".join(p))
def test_every_command_help_works(
    path: tuple[str, ...], invoke: Callable[[list[str]], tuple[int, str, str]]
) -> None:
    code, out, err = invoke([*path, "--help"])
    assert code == 0, err
    assert "Usage:" in out and "--json" in out
    assert LEAVES[path].help, f"kvcal {' '.join(path)} has no description"


def test_json_has_one_help_everywhere() -> None:
    found = _params_with_flag("--json")
    assert {name for name, _ in found} == {" ".join(path) for path in LEAVES}  # every command offers --json
    for name, param in found:
        assert param.help == options.JSON_HELP, name


def test_model_argument_has_one_help_everywhere() -> None:
    models = [
        (" ".join(path), p) for path, cmd in LEAVES.items() for p in cmd.params if isinstance(p, typer.core.TyperArgument)
        if p.name == "model"
    ]  # fmt: skip
    assert {name for name, _ in models} == {
        "capacity",
        "calibrate",
        "sensitivity",
        "verify",
        "drift",
        "export",
        "eval",
        "release",
        "plan",
        "probe",
    }
    assert {p.help for _, p in models} == {options.MODEL_HELP}


@pytest.mark.parametrize(
    "alias",
    [
        options.KvFormatOpt,
        options.DtypeOpt,
        options.DeviceOpt,
        options.SkipLayersOpt,
        options.DatasetOpt,
        options.TextFieldOpt,
        options.NumSamplesOpt,
        options.SeqLenOpt,
    ],
    ids=lambda a: sorted(_flags_and_help(a)[0])[-1],
)
def test_shared_options_read_the_same_everywhere(alias: object) -> None:
    flags, help_text = _flags_and_help(alias)
    long_flag = max(flags, key=len)
    found = _params_with_flag(long_flag)
    assert len(found) >= 2, f"{long_flag} is shared by fewer than two commands"
    for name, param in found:
        assert set(param.opts) == flags, name
        if name == "capacity":  # capacity's --kv-format is the repeatable KvFormatsOpt
            continue
        if (name, long_flag) in FROM_MANIFEST:  # drift: the default is what the scale file's calibration used
            assert param.help == _flags_and_help(FROM_MANIFEST[name, long_flag])[1], name
            continue
        assert param.help == help_text, name


FROM_MANIFEST = {("drift", "--dtype"): options.ManifestDtypeOpt, ("drift", "--seq-len"): options.ManifestSeqLenOpt}


def test_every_eval_config_field_has_an_option() -> None:
    names = {p.name for p in LEAVES[("eval",)].params}
    missing = {f.name for f in fields(EvalConfig)} - names - eval_commands.FIELDS_WITHOUT_OPTION
    assert not missing, f"EvalConfig fields without a `kvcal eval` option: {sorted(missing)}"
    assert names - {f.name for f in fields(EvalConfig)} == set(eval_commands.CLI_ONLY)


def test_eval_options_build_the_config_with_its_defaults() -> None:
    ctx = LEAVES[("eval",)].make_context("eval", ["m", "-f", "fp8", "--tasks", "kl,wikitext", "-o", "run"])
    config = options.config_from_options(
        EvalConfig, ctx.params, cli_only=eval_commands.CLI_ONLY, no_option=eval_commands.FIELDS_WITHOUT_OPTION
    )
    assert config == EvalConfig(model="m", kv_format="fp8", tasks=["kl,wikitext"], output="run")


def test_calibrate_options_are_calibrate_arguments() -> None:
    from kvcal.calibrate.run import calibrate

    ctx = LEAVES[("calibrate",)].make_context("calibrate", ["m", "-f", "fp8", "-o", "s.safetensors"])
    kwargs = options.library_kwargs(calibrate, ctx.params, cli_only=calibrate_commands.CLI_ONLY)
    bound = inspect.signature(calibrate).bind(**kwargs, progress=None, observer_params=None)
    assert bound.arguments["seq_len"] == 512 and bound.arguments["kv_format"] == "fp8"


@dataclass
class _Cfg:
    a: int
    b: str = "x"


def test_config_from_options_refuses_a_forgotten_field_or_a_stray_option() -> None:
    assert options.config_from_options(
        _Cfg, {"a": 1, "b": "y", "json_out": True}, cli_only=["json_out"]
    ) == _Cfg(1, "y")
    assert options.config_from_options(_Cfg, {"a": 1}, no_option=["b"]) == _Cfg(1)
    with pytest.raises(TypeError, match=r"\['b'\] have no CLI option"):
        options.config_from_options(_Cfg, {"a": 1})
    with pytest.raises(TypeError, match=r"\['c'\] match nothing of _Cfg"):
        options.config_from_options(_Cfg, {"a": 1, "b": "y", "c": 0})


def test_library_kwargs_refuses_an_option_the_function_does_not_take() -> None:
    def f(a: int, b: int = 0) -> None: ...

    assert options.library_kwargs(f, {"a": 1, "json_out": False}, cli_only=["json_out"]) == {"a": 1}
    with pytest.raises(TypeError, match=r"\['c'\] match nothing"):
        options.library_kwargs(f, {"a": 1, "c": 2})


# calibrate, sensitivity, drift and plan build their library config by name like eval; the CLI's defaults are the
# config's but for the ones named here (calibrate quantizes K/V as eval does: rounded to bfloat16 first).
SPEC_COMMANDS = [
    (("calibrate",), ["m", "-f", "fp8", "-o", "s.safetensors"], "kvcal.calibrate.run", "CalibrateConfig",
     {"model": "m", "kv_format": "fp8", "output": Path("s.safetensors"), "kv_input_dtype": "bfloat16"}),
    (("sensitivity",), ["m", "-f", "fp8"], "kvcal.pipeline.sensitivity", "SensitivityConfig",
     {"model": "m", "kv_format": "fp8"}),
    (("drift",), ["s.safetensors", "m"], "kvcal.calibrate.drift", "DriftConfig",
     {"scales": Path("s.safetensors"), "model": "m"}),
    (("plan",), ["m"], "kvcal.pipeline.plan", "PlanConfig", {"model": "m"}),
]  # fmt: skip


@pytest.mark.parametrize(("path", "argv", "module", "name", "given"), SPEC_COMMANDS, ids=lambda x: str(x))
def test_spec_commands_build_their_config_with_its_defaults(
    path: tuple[str, ...], argv: list[str], module: str, name: str, given: dict[str, Any]
) -> None:
    import importlib

    cls = getattr(importlib.import_module(module), name)
    command = importlib.import_module(f"kvcal.commands.{path[0]}")
    ctx = LEAVES[path].make_context(path[0], argv)
    config = options.config_from_options(
        cls, ctx.params, cli_only=command.CLI_ONLY, no_option=getattr(command, "FIELDS_WITHOUT_OPTION", ())
    )
    assert config == cls(**given)


def test_keyword_entry_points_take_exactly_their_configs_fields() -> None:
    from kvcal.calibrate.drift import DriftConfig, check_drift
    from kvcal.calibrate.run import CalibrateConfig, calibrate
    from kvcal.pipeline.sensitivity import SensitivityConfig, sensitivity

    for fn, cls, renamed in ((calibrate, CalibrateConfig, {}), (sensitivity, SensitivityConfig, {}),
                             (check_drift, DriftConfig, {"scales_path": "scales"})):  # fmt: skip
        params = {renamed.get(p, p) for p in inspect.signature(fn).parameters} - {"progress"}
        assert params == {f.name for f in fields(cls)}, fn.__name__
