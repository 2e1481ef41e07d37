"""A fake CUDA device for driving efflab's `device.type == "cuda"` branches on a CPU-only machine.

The `fake_cuda` fixture monkeypatches torch.cuda (is_available, Event, synchronize, the caching allocator's
counters, mem_get_info, the device's name, capability, properties and bf16 support) and puts a fake `pynvml` in
sys.modules. Everything it reports is set by the test, never read from the machine:

- a simulated GPU clock in milliseconds (`advance(ms)`): a FakeEvent's record() reads it, elapsed_time() is the
  difference of two records, so timings are exact arithmetic, never wall time. As on a real GPU, an event's time
  can be read only once it has completed, i.e. after a torch.cuda.synchronize() (or event.synchronize()) that
  follows its record(): code that reads an event without synchronising first fails here as it would there;
- the allocator (`allocate(mib)`, `free(mib)`, `empty_cache()`): current and peak allocated and reserved bytes,
  with torch's semantics (reserved grows to hold what is allocated and stays after a free; reset_peak_memory_stats
  sets the peaks to the current values);
- the card (`name`, `capability`, `total_mib`, `bf16`, `uuid`) and NVML's view of this process (`nvml_process_mib`,
  None: NVML does not list it; `nvml_error`: every NVML call raises) and the board's energy counter (`spend(J)`).

Tensors stay on the CPU. Pass torch.device("cuda") where the code only branches on device.type; where code really
makes a tensor on its device (torch.zeros(..., device=device)), `keep_tensors_on_cpu(module)` narrowly replaces
that module's `torch` with a proxy whose tensor factories drop a CUDA device (see there).

Import heavy libraries before the fixture runs, not under it: a library imported while torch.cuda.is_available() says
True may set itself up for CUDA (importing transformers.Trainer under the fake makes bitsandbytes look for
libcudart.so and fail). And torch.optim's first optimizer, like torch.testing, imports torch._dynamo (~8 s here).
"""
from __future__ import annotations

import os
import sys
import types

import pytest
import torch

MiB = 1024 * 1024


class FakeEvent:
    """torch.cuda.Event on the fake's simulated clock."""

    def __init__(self, fake: "FakeCuda", enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False):
        self.fake, self.enable_timing = fake, enable_timing
        self.ms: float | None = None  # the clock when recorded
        self.completed = False
        fake.events.append(self)

    def record(self, stream=None) -> None:
        self.ms = self.fake.now_ms
        self.completed = False
        self.fake.records += 1

    def query(self) -> bool:
        return self.completed

    def synchronize(self) -> None:
        if self.ms is not None:
            self.completed = True

    def wait(self, stream=None) -> None:
        pass

    def elapsed_time(self, end_event: "FakeEvent") -> float:
        """Milliseconds from this event's record to `end_event`'s, as torch gives it."""
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'")
        if self.ms is None or end_event.ms is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time")
        if not (self.completed and end_event.completed):
            raise RuntimeError("CUDA error: device not ready (elapsed_time of an event not yet completed: "
                               "synchronize first)")
        return end_event.ms - self.ms


class FakeNVMLError(Exception):
    pass


class FakeCuda:
    """The state behind the fake device; the fixture installs it (`install`) and returns it."""

    def __init__(self):
        self.now_ms = 0.0
        self.events: list[FakeEvent] = []
        self.records = 0
        self.synchronize_calls = 0
        # the caching allocator, in bytes
        self.allocated = self.peak_allocated = self.reserved = self.peak_reserved = 0
        self.peak_resets = 0
        # the card
        self.name = "NVIDIA H100 80GB HBM3"
        self.capability = (9, 0)
        self.total_mib = 81559
        self.bf16 = True
        self.uuid = "5f0b2c3e-1a2b-4c5d-8e9f-0123456789ab"  # as torch gives it: without NVML's "GPU-" prefix
        self.multi_processor_count = 132
        self.context_mib = 500.0  # memory outside the allocator (CUDA context), taken from mem_get_info's free
        self.memory_fraction: float | None = None
        # NVML
        self.nvml_process_mib: float | None = 1024.0
        self.nvml_error: str | None = None
        self.energy_mj = 0
        self.nvml_inits = self.nvml_shutdowns = 0
        self.nvml_handles: list[tuple[str, object]] = []

    # -- what a test drives ------------------------------------------------------------------------------------
    def advance(self, ms: float) -> None:
        """Let `ms` milliseconds of GPU time pass."""
        self.now_ms += ms

    def allocate(self, mib: float) -> None:
        """Allocate `mib` MiB: current and peak allocated rise; reserved grows (never shrinks) to hold them."""
        self.allocated += int(mib * MiB)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.reserved = max(self.reserved, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, mib: float) -> None:
        """Free `mib` MiB: allocated falls, the allocator keeps the memory reserved."""
        self.allocated -= int(mib * MiB)
        assert self.allocated >= 0, "freed more than was allocated"

    def empty_cache(self) -> None:
        self.reserved = self.allocated

    def spend(self, joules: float) -> None:
        """The board uses `joules` (NVML's total-energy counter counts millijoules)."""
        self.energy_mj += round(joules * 1000)

    # -- torch.cuda ---------------------------------------------------------------------------------------------
    def _device_index(self, device=None) -> int:
        if isinstance(device, torch.device):
            assert device.type == "cuda", f"a CUDA call on {device}"
            return device.index or 0
        if isinstance(device, str):
            return self._device_index(torch.device(device))
        return device or 0

    def synchronize(self, device=None) -> None:
        self._device_index(device)
        self.synchronize_calls += 1
        for event in self.events:
            event.synchronize()

    def reset_peak_memory_stats(self, device=None) -> None:
        self._device_index(device)
        self.peak_resets += 1
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def memory_allocated(self, device=None) -> int:
        self._device_index(device)
        return self.allocated

    def max_memory_allocated(self, device=None) -> int:
        self._device_index(device)
        return self.peak_allocated

    def memory_reserved(self, device=None) -> int:
        self._device_index(device)
        return self.reserved

    def max_memory_reserved(self, device=None) -> int:
        self._device_index(device)
        return self.peak_reserved

    def mem_get_info(self, device=None) -> tuple[int, int]:
        self._device_index(device)
        total = int(self.total_mib * MiB)
        return total - self.reserved - int(self.context_mib * MiB), total

    def get_device_name(self, device=None) -> str:
        self._device_index(device)
        return self.name

    def get_device_capability(self, device=None) -> tuple[int, int]:
        self._device_index(device)
        return self.capability

    def get_device_properties(self, device=None):
        self._device_index(device)
        return types.SimpleNamespace(name=self.name, total_memory=int(self.total_mib * MiB),
                                     major=self.capability[0], minor=self.capability[1], uuid=self.uuid,
                                     multi_processor_count=self.multi_processor_count)

    def is_bf16_supported(self, including_emulation: bool = True) -> bool:
        return self.bf16

    def set_per_process_memory_fraction(self, fraction: float, device=None) -> None:
        self._device_index(device)
        self.memory_fraction = fraction

    # -- pynvml ---------------------------------------------------------------------------------------------------
    def pynvml(self) -> types.ModuleType:
        fake = self
        module = types.ModuleType("pynvml")
        module.NVMLError = FakeNVMLError

        def check():
            if fake.nvml_error:
                raise FakeNVMLError(fake.nvml_error)

        def init():
            check()
            fake.nvml_inits += 1

        def shutdown():
            fake.nvml_shutdowns += 1

        def by_index(index):
            check()
            fake.nvml_handles.append(("index", index))
            return ("handle", index)

        def by_uuid(uuid):
            check()
            if uuid != "GPU-" + fake.uuid.removeprefix("GPU-"):  # NVML's form of the UUID
                raise FakeNVMLError(f"NVML_ERROR_NOT_FOUND: no GPU {uuid!r}")
            fake.nvml_handles.append(("uuid", uuid))
            return ("handle", 0)

        def processes(handle):
            check()
            assert handle == ("handle", 0), handle
            others = [types.SimpleNamespace(pid=os.getpid() + 1, usedGpuMemory=7 * MiB)]  # another process's
            if fake.nvml_process_mib is None:
                return others
            return others + [types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=int(fake.nvml_process_mib * MiB))]

        def energy(handle):
            check()
            assert handle == ("handle", 0), handle
            return fake.energy_mj

        module.nvmlInit, module.nvmlShutdown = init, shutdown
        module.nvmlDeviceGetHandleByIndex, module.nvmlDeviceGetHandleByUUID = by_index, by_uuid
        module.nvmlDeviceGetComputeRunningProcesses = processes
        module.nvmlDeviceGetTotalEnergyConsumption = energy
        module.nvmlDeviceGetCount = lambda: 1
        module.nvmlDeviceGetName = lambda handle: fake.name
        module.nvmlSystemGetDriverVersion = lambda: "550.54.15"
        return module

    # -- installation ---------------------------------------------------------------------------------------------
    def install(self, monkeypatch) -> "FakeCuda":
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "device_count", lambda: 1)
        monkeypatch.setattr(cuda, "current_device", lambda: 0)
        monkeypatch.setattr(cuda, "init", lambda: None)
        # accelerate's state (set up by an earlier test in the worker) selects the device: one device, nothing to do
        monkeypatch.setattr(cuda, "set_device", lambda device: None)
        monkeypatch.setattr(cuda, "Event", lambda *args, **kwargs: FakeEvent(self, *args, **kwargs))
        for name in ("synchronize", "reset_peak_memory_stats", "memory_allocated", "max_memory_allocated",
                     "memory_reserved", "max_memory_reserved", "mem_get_info", "get_device_name",
                     "get_device_capability", "get_device_properties", "is_bf16_supported", "empty_cache",
                     "set_per_process_memory_fraction"):
            monkeypatch.setattr(cuda, name, getattr(self, name))
        monkeypatch.setattr(torch.version, "cuda", "12.4")
        monkeypatch.setitem(sys.modules, "pynvml", self.pynvml())
        self.monkeypatch = monkeypatch
        return self

    def keep_tensors_on_cpu(self, module: types.ModuleType) -> None:
        """Replace `module`'s global `torch` (only that module's) with a proxy whose tensor factories make CPU tensors
        when asked for a CUDA device; everything else is torch itself. For code that makes a tensor on the device it
        branches on (training.training_step's loss accumulator), which a CPU-only torch cannot do."""
        self.monkeypatch.setattr(module, "torch", CpuTensorTorch())


class CpuTensorTorch(types.ModuleType):
    """torch, with torch.zeros/ones/empty/full/tensor/randn/arange making CPU tensors where a CUDA device is asked."""

    FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "randn", "rand", "arange", "zeros_like", "ones_like")

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        real = getattr(torch, name)
        if name not in self.FACTORIES:
            return real

        def on_cpu(*args, device=None, **kwargs):
            if device is not None and torch.device(device).type == "cuda":
                device = "cpu"
            return real(*args, device=device, **kwargs)
        return on_cpu


@pytest.fixture
def fake_cuda(monkeypatch) -> FakeCuda:
    """A fake CUDA device (see the module's docstring): torch.cuda and pynvml patched for the test, undone after."""
    return FakeCuda().install(monkeypatch)
