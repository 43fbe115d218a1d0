"""Where a model's weights live when it does not fit one device: accelerate's big-model dispatch, as
`transformers.AutoModelForCausalLM.from_pretrained(device_map=..., max_memory=..., offload_folder=...)` takes it.

    --device-map auto | balanced | balanced_low_0 | sequential | FILE.json
    --max-memory 0=20GiB,cpu=64GiB      (accelerate's max_memory: GPU index or cpu/mps/disk -> size)
    --offload-folder DIR                (where layers mapped to "disk" are written, memory-mapped back per forward)

A FILE.json is accelerate's explicit map, module name -> device: `{"model.embed_tokens": 0, "model.layers.0": 0,
..., "model.layers.29": "disk", "model.norm": "cpu", "lm_head": 0}` (an int is a CUDA index; "cpu", "disk",
"cuda:N", "mps" work too). transformers refuses a map that leaves a parameter without a device.

Every check that needs no weights runs before the load: the devices named exist here (one error naming the device
and the devices this machine has), "disk" comes with --offload-folder, and --max-memory leaves room for at least one
decoder layer (accelerate never splits one; the error says how much one needs, measured on an empty-weight copy).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcal.errors import UsageError

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
DeviceMap = str | dict[str, int | str]


@dataclass(kw_only=True)
class PlacementOptions:
    """--device-map / --max-memory / --offload-folder as given: the option group of a command's config (eval,
    calibrate, sensitivity inherit it; keyword-only, so it adds no positional argument)."""

    device_map: str | None = None
    max_memory: str | None = None
    offload_folder: str | None = None

    def placement(self) -> Placement:
        """The group parsed (`Placement.parse`); its devices are checked by `Placement.check`."""
        return Placement.parse(self.device_map, self.max_memory, self.offload_folder)


@dataclass(frozen=True)
class Placement:
    """A device map (a strategy name or module -> device), optional memory budget per device, offload folder."""

    device_map: DeviceMap | None = None
    max_memory: dict[int | str, str] | None = None
    offload_folder: str | None = None
    source: str | None = None  # the --device-map value as given (a file's path for messages)

    @property
    def active(self) -> bool:
        return self.device_map is not None

    @classmethod
    def parse(
        cls, device_map: str | None, max_memory: str | None = None, offload_folder: str | None = None
    ) -> Placement:
        """From the command-line strings; UsageError for a malformed value (no device is looked at yet)."""
        if device_map in (None, ""):
            if max_memory or offload_folder:
                raise UsageError(
                    "--max-memory / --offload-folder place a model with a device map; add --device-map auto "
                    "(or balanced, sequential, FILE.json)"
                )
            return cls()
        dm = str(device_map)
        parsed: DeviceMap = dm if dm in STRATEGIES else _read_map_file(dm)
        folder = str(Path(offload_folder).expanduser()) if offload_folder else None
        return cls(parsed, parse_max_memory(max_memory) if max_memory else None, folder, dm)

    def devices(self) -> list[tuple[str, int | str]]:
        """(where it is named, device) for every device the map and --max-memory name."""
        named: list[tuple[str, int | str]] = []
        if isinstance(self.device_map, dict):
            named += [(f"module '{m}' of --device-map {self.source}", d) for m, d in self.device_map.items()]
        named += [(f"--max-memory {_key(k)}", k) for k in self.max_memory or {}]
        return named

    def check(self) -> None:
        """UsageError before any load: a device this machine lacks, "disk" without an offload folder, an
        offload folder that cannot be written."""
        for where, dev in self.devices():
            if not device_exists(dev):
                raise UsageError(
                    f"{where} names device '{_key(dev)}', which this machine does not have "
                    f"(devices here: {', '.join(available_devices())}); edit it or use --device-map auto"
                )
        if (
            isinstance(self.device_map, dict)
            and "disk" in self.device_map.values()
            and not self.offload_folder
        ):
            raise UsageError(
                f"--device-map {self.source} puts modules on 'disk'; add --offload-folder DIR for their weights"
            )
        if self.offload_folder:
            folder = Path(self.offload_folder)
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise UsageError(
                    f"--offload-folder {folder}: {exc.strerror or exc}; choose a writable folder"
                ) from None
            if not os.access(folder, os.W_OK | os.X_OK):
                raise UsageError(f"--offload-folder {folder} is not writable; choose a writable folder")

    def from_pretrained_kwargs(self) -> dict[str, Any]:
        if not self.active:
            return {}
        kwargs: dict[str, Any] = {"device_map": self.device_map}
        if self.max_memory:
            kwargs["max_memory"] = dict(self.max_memory)
        if self.offload_folder:
            kwargs["offload_folder"] = self.offload_folder
        return kwargs

    def describe(self) -> dict[str, Any]:
        """For manifests and run records: what was asked (not where each module landed)."""
        return {
            "device_map": self.source,
            "max_memory": {_key(k): v for k, v in (self.max_memory or {}).items()} or None,
            "offload_folder": self.offload_folder,
        }


def _read_map_file(path_text: str) -> dict[str, int | str]:
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise UsageError(
            f"--device-map '{path_text}' is neither a strategy ({', '.join(STRATEGIES)}) nor an existing "
            ".json file"
        )
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(
            f'--device-map {path}: not valid JSON ({exc}); write {{"module": device, ...}}'
        ) from None
    if not isinstance(obj, dict) or not obj:
        raise UsageError(f'--device-map {path}: expected a JSON object {{"module name": device, ...}}')
    out: dict[str, int | str] = {}
    for module, dev in obj.items():
        if isinstance(dev, bool) or not isinstance(dev, int | str):
            raise UsageError(
                f"--device-map {path}: module '{module}' has device {dev!r}; use a GPU index, 'cpu' or 'disk'"
            )
        out[str(module)] = _normalise(dev)
    return out


def _normalise(dev: int | str) -> int | str:
    """accelerate's spelling: CUDA devices as ints, others as lower-case names."""
    if isinstance(dev, int):
        return dev
    name = dev.strip().lower()
    m = re.fullmatch(r"(?:cuda:)?(\d+)", name)
    return int(m.group(1)) if m else name


def _key(dev: int | str) -> str:
    return f"cuda:{dev}" if isinstance(dev, int) else str(dev)


def parse_max_memory(text: str) -> dict[int | str, str]:
    """'0=20GiB,cpu=64GiB' -> {0: '20GiB', 'cpu': '64GiB'} (accelerate's max_memory); sizes checked now."""
    from accelerate.utils import convert_file_size_to_int

    out: dict[int | str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        dev, sep, size = part.partition("=")
        if not sep or not dev.strip() or not size.strip():
            raise UsageError(f"--max-memory '{part}': write DEVICE=SIZE pairs like 0=20GiB,cpu=64GiB")
        try:
            convert_file_size_to_int(size.strip())
        except ValueError:
            raise UsageError(
                f"--max-memory '{part}': '{size.strip()}' is not a size; use e.g. 20GiB, 512MiB or 64GB"
            ) from None
        out[_normalise(dev)] = size.strip()
    if not out:
        raise UsageError("--max-memory is empty; write DEVICE=SIZE pairs like 0=20GiB,cpu=64GiB")
    return out


def available_devices() -> list[str]:
    import torch

    devs = ["cpu", "disk"]
    if torch.cuda.is_available():
        devs[1:1] = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    elif torch.backends.mps.is_available():
        devs.insert(1, "mps")
    return devs


def device_exists(dev: int | str) -> bool:
    return _key(dev) in available_devices()


def size_bytes(size: str) -> int:
    from accelerate.utils import convert_file_size_to_int

    return int(convert_file_size_to_int(size))


def largest_layer_bytes(config: Any, dtype: Any) -> tuple[int, str]:
    """(bytes, module name) of the largest module accelerate will not split (a decoder layer), measured on an
    empty-weight (meta) copy of the model at `dtype`: nothing is read or allocated."""
    from accelerate import init_empty_weights
    from accelerate.utils import compute_module_sizes
    from transformers import AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    sizes = compute_module_sizes(model, dtype=dtype)
    keep = tuple(getattr(model, "_no_split_modules", None) or ())
    best = (0, "")
    for name, module in model.named_modules():
        if name and type(module).__name__ in keep and sizes.get(name, 0) > best[0]:
            best = (int(sizes[name]), name)
    return best


def check_memory_fits(placement: Placement, config: Any, dtype: Any, model: str) -> None:
    """UsageError when every --max-memory budget (disk aside) is smaller than one decoder layer: accelerate
    places a layer whole, and a disk-offloaded layer still runs in memory, so no layout could run."""
    budgets = {k: v for k, v in (placement.max_memory or {}).items() if k != "disk"}
    if not budgets:
        return
    need, name = largest_layer_bytes(config, dtype)
    largest = max(size_bytes(v) for v in budgets.values())
    if need and largest < need:
        given = ",".join(f"{_key(k)}={v}" for k, v in budgets.items())
        raise UsageError(
            f"--max-memory {given} is too small for one decoder layer of {model}: '{name}' needs "
            f"{need / 2**20:.1f} MiB at {str(dtype).replace('torch.', '')}; give one device at least "
            f"{need / 2**20:.1f} MiB"
        )
