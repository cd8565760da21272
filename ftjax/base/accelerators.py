"""Known accelerators: memory and peak dense FLOP/s per device, by device kind.

`ftjax plan` checks a config against a device of this table (`--device-kind`), `ftjax train` runs the
same fit check before it allocates, and a step's MFU divides by the peak. A device is found by its
JAX `device_kind` (`jax.devices()[0].device_kind`, e.g. "NVIDIA H100 80GB HBM3", "TPU v5 lite") or
by a short name ("H100", "v5e"): the first entry one of whose names is a substring of it (case
ignored), so a more specific entry comes before a more general one.

Figures are the vendors' public data sheets, per device (a GPU, a TPU chip), dense (NVIDIA's tensor
core figures with 2:4 sparsity are twice these):

- NVIDIA H100 Tensor Core GPU data sheet (SXM5 80 GB HBM3; PCIe 80 GB HBM2e; NVL 94 GB): BF16
  1,979 / 1,513 / 1,671 TFLOPS with sparsity, FP32 67 / 51 / 60 TFLOPS.
- NVIDIA H200 Tensor Core GPU data sheet (SXM 141 GB HBM3e; NVL 141 GB): BF16 1,979 / 1,671 TFLOPS
  with sparsity, FP32 67 / 60 TFLOPS.
- NVIDIA GH200 Grace Hopper Superchip data sheet (96 GB HBM3 or 144 GB HBM3e): as H100 SXM.
- NVIDIA A100 Tensor Core GPU data sheet (40 GB HBM2, 80 GB HBM2e): BF16 312 TFLOPS dense
  (624 with sparsity), FP32 19.5 TFLOPS.
- Google Cloud TPU system architecture pages (cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e):
  v4 275 TFLOPS bf16 and 32 GiB HBM2; v5e 197 TFLOPS bf16 and 16 GB HBM2; v5p 459 TFLOPS bf16 and
  95 GB HBM2e; v6e (Trillium) 918 TFLOPS bf16 and 32 GB HBM. No fp32 peak is published for TPUs.

Memory is taken as GiB (HBM stacks come in binary sizes: an H100 SXM's 80 GB are five 16 GiB
stacks). A program sees slightly less (ECC and the driver's reserve), and JAX's GPU allocator by
default keeps to a fraction of it (XLA_PYTHON_CLIENT_MEM_FRACTION): on a device, `ftjax train`
reads the allocator's own limit instead when JAX reports one.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30
TFLOPS = 1e12


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_bytes: int
    peak_bf16_flops: float  # dense, per device
    peak_fp32_flops: float | None  # dense, per device (None: not published)
    names: tuple[str, ...]  # substrings of a device kind (lower case) that select this entry

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB


def _gpu(name: str, gib: float, bf16_sparse_tflops: float, fp32_tflops: float, *names: str) -> Accelerator:
    return Accelerator(name, int(gib * GIB), bf16_sparse_tflops / 2 * TFLOPS, fp32_tflops * TFLOPS, names)


def _tpu(name: str, gib: float, bf16_tflops: float, *names: str) -> Accelerator:
    return Accelerator(name, int(gib * GIB), bf16_tflops * TFLOPS, None, names)


# Most specific first: "h100 pcie" before "h100", "tpu v5 lite" before "tpu v5".
KNOWN: tuple[Accelerator, ...] = (
    _gpu("NVIDIA H100 PCIe 80GB", 80, 1513, 51, "h100 pcie", "h100-pcie"),
    _gpu("NVIDIA H100 NVL 94GB", 94, 1671, 60, "h100 nvl"),
    _gpu("NVIDIA H100 SXM 80GB HBM3", 80, 1979, 67, "h100"),
    _gpu("NVIDIA GH200 96GB HBM3", 96, 1979, 67, "gh200"),  # (the 144 GB HBM3e one: --device-memory-gib)
    _gpu("NVIDIA H200 NVL 141GB", 141, 1671, 60, "h200 nvl"),
    _gpu("NVIDIA H200 SXM 141GB HBM3e", 141, 1979, 67, "h200"),
    _gpu("NVIDIA A100 80GB", 80, 624, 19.5, "a100-sxm4-80gb", "a100 80gb", "a100-80gb", "a100-pcie-80gb"),
    _gpu("NVIDIA A100 40GB", 40, 624, 19.5, "a100"),
    _tpu("TPU v5e", 16, 197, "tpu v5 lite", "tpu v5e", "v5e", "v5litepod"),
    _tpu("TPU v5p", 95, 459, "tpu v5p", "v5p", "tpu v5"),
    _tpu("TPU v6e", 32, 918, "tpu v6 lite", "tpu v6e", "v6e"),
    _tpu("TPU v4", 32, 275, "tpu v4", "v4"),
)


def lookup(kind: str) -> Accelerator | None:
    """The table's entry for a device kind or short name, or None (a CPU, an unknown device)."""
    k = " ".join(kind.lower().split())
    return next((a for a in KNOWN if any(n in k for n in a.names)), None)


def known_names() -> str:
    """The table's entries, for an error message."""
    return ", ".join(a.name for a in KNOWN)
