"""How a linear's weight is stored: its format (:class:`WeightFormat`), which the weight
carries and the linear applies in one place.

    W[n, k] = q[n, k] * scale(n, k)

``q`` is the stored tensor, in the format's storage type; ``scale`` is none (1), one float32
per output channel (``scale[n]``), or one per row and 128-column block of K
(``scale[n, k // 128]``). Checkpoints of 128 x 128 blocks (transformers' ``fp8`` method,
``weight_scale_inv`` ``[ceil(N/128), ceil(K/128)]``) give each row its block's scales
(:func:`block_scales_per_row`): a row's scales then follow it wherever the model moves it
(the RoPE pairs of q and k side by side, gate and up rows interleaved), and a tile of any
rows finds its own. The linear's tiles multiply the stored values as they are and apply the
scale in one place: a per-channel scale finishes each tile's float32 product (before any
epilogue: bias, residual, SiLU·mul, RoPE, the argmax or a sum over ranks; a split-K partial
is finished the same way, so its reduce sums finished products); a block scale, constant
over a K chunk of a row (chunks of at most 128 columns, aligned), scales each chunk's
products as they are accumulated.

FP8 is e4m3 (``torch.float8_e4m3fn``, max 448). Its values are exact in bfloat16 and in
float32, so on the CPU (the Triton interpreter computes in float32) an FP8 weight is held in
float32 with the same values and the same scales, and runs the same scaled code path.

Adding a format (int8, int4) is a new :class:`WeightFormat` here, its quantizer and
dequantizer, and its load in the tiles; the planner prices any format by its bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: The largest finite e4m3 value (torch.float8_e4m3fn).
FP8_MAX = 448.0
#: Rows and columns of a block of a block-scaled weight.
SCALE_BLOCK = 128
#: Codes of the scale layouts in the tiles (the constexpr ``W_SCALE``).
SCALE_NONE, SCALE_CHANNEL, SCALE_BLOCK_CODE = 0, 1, 2


@dataclass(frozen=True)
class WeightFormat:
    """A stored weight's element type and scales (see the module docstring).

    ``name``: how it is named (a plan's listing, ``footprint()``, the CLI); ``quantized``:
    its values are FP8 e4m3 (None: stored as they are, in the model's dtype); ``scales``:
    ``"none"``, ``"channel"`` or ``"block"``."""

    name: str
    quantized: str | None = None
    scales: str = "none"

    @property
    def scale_code(self) -> int:
        """The tiles' ``W_SCALE``: 0 none, 1 per output channel, 2 per 128 x 128 block."""
        return {"none": SCALE_NONE, "channel": SCALE_CHANNEL, "block": SCALE_BLOCK_CODE}[self.scales]

    def element_bytes(self, dtype_bytes: int) -> int:
        """Bytes of a stored element on a GPU (``dtype_bytes``: the model's dtype's)."""
        return 1 if self.quantized else dtype_bytes

    def scale_shape(self, N: int, K: int) -> tuple[int, ...] | None:
        """Shape of the float32 scales of an ``[N, K]`` weight (None: no scales): ``[N]``, or a
        row's scale per 128 columns ``[N, ceil(K/128)]``."""
        if self.scales == "channel":
            return (N,)
        if self.scales == "block":
            return (N, -(-K // SCALE_BLOCK))
        return None

    def nbytes(self, N: int, K: int, dtype_bytes: int) -> int:
        """Bytes of an ``[N, K]`` weight in this format on a GPU, its scales included."""
        shape = self.scale_shape(N, K)
        scales = 4 * (shape[0] * (shape[1] if len(shape) > 1 else 1)) if shape else 0
        return N * K * self.element_bytes(dtype_bytes) + scales

    def storage_dtype(self, device: torch.device, dtype: torch.dtype) -> torch.dtype:
        """The tensor dtype of the stored values on ``device`` (a model of ``dtype``): FP8 on a
        GPU, float32 holding the same values on the CPU (the interpreter computes in float32)."""
        if self.quantized and torch.device(device).type == "cuda":
            return torch.float8_e4m3fn
        return dtype if not self.quantized else torch.float32

    def quantize(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(q, scale)`` of a float weight ``[N, K]``: e4m3 values (as float32) and float32
        scales with ``q * scale ~ w`` (each channel's, or block's, largest magnitude at 448);
        ``scale`` None where the format has none."""
        if not self.quantized:
            return w, None
        w = w.float()
        if self.scales == "channel":
            scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_min(1e-12)
            q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
            return q, scale
        if self.scales == "block":  # 128 x 128 blocks, each row given its block's scales
            N, K = w.shape
            scale = block_scales_per_row((_block_amax(w.abs()) / FP8_MAX).clamp_min(1e-12), N)
            q = (w / expand_columns(scale, K)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
            return q, scale
        raise ValueError(f"{self.name}: FP8 needs scales (per channel or per block)")

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """The float32 weight ``q * scale`` (the reference the tiles must match)."""
        w = q.float()
        if self.scales == "channel":
            return w * scale.float()[:, None]
        if self.scales == "block":
            return w * expand_columns(scale.float(), w.shape[1])
        return w

    def check_scale(self, name: str, q_shape: tuple[int, ...], scale: torch.Tensor | None) -> None:
        """ValueError naming tensor ``name`` when its scales do not fit this format and an
        ``[N, K]`` weight: missing, of another shape, or not finite and positive."""
        want = self.scale_shape(*q_shape)
        if want is None:
            if scale is not None:
                raise ValueError(f"{name}: a {self.name} weight has no scales, got a tensor of {tuple(scale.shape)}")
            return
        if scale is None:
            raise ValueError(f"{name}: a {self.name} weight needs its scales {want}, none given")
        if tuple(scale.shape) != want:
            raise ValueError(f"{name}: scales of shape {tuple(scale.shape)}, expected {want} for a {self.name} "
                             f"weight of {tuple(q_shape)}")
        s = scale.float()
        if not bool(torch.isfinite(s).all()) or not bool((s > 0).all()):
            raise ValueError(f"{name}: scales must be finite and > 0 (found NaN, Inf, zero or negative ones)")


def block_scales_per_row(blocks: torch.Tensor, N: int) -> torch.Tensor:
    """128 x 128 block scales ``[ceil(N/128), ceil(K/128)]`` as each row's ``[N, ceil(K/128)]``."""
    # (a gather, so the result owns its N rows: a slice of the repeated blocks would keep
    # their padding to a multiple of 128 rows alive)
    return blocks[torch.arange(N, device=blocks.device) // SCALE_BLOCK]


def expand_columns(scale: torch.Tensor, K: int) -> torch.Tensor:
    """A row's scale per 128 columns ``[N, ceil(K/128)]`` as one scale an element ``[N, K]``."""
    return scale.repeat_interleave(SCALE_BLOCK, 1)[:, :K]


def _block_amax(w: torch.Tensor) -> torch.Tensor:
    """Each 128 x 128 block's largest value of ``w`` ``[N, K]``: ``[ceil(N/128), ceil(K/128)]``."""
    N, K = w.shape
    b = SCALE_BLOCK
    padded = torch.zeros(-(-N // b) * b, -(-K // b) * b, dtype=w.dtype, device=w.device)
    padded[:N, :K] = w
    return padded.view(-(-N // b), b, -(-K // b), b).amax(dim=(1, 3))


#: The formats mk runs, by name.
PLAIN = WeightFormat("plain")
FP8_CHANNEL = WeightFormat("fp8", "e4m3", "channel")
FP8_BLOCK = WeightFormat("fp8-block", "e4m3", "block")
FORMATS = {f.name: f for f in (PLAIN, FP8_CHANNEL, FP8_BLOCK)}


def weight_format(name: str) -> WeightFormat:
    """The format named ``name`` (:data:`FORMATS`); ValueError naming the known ones."""
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown weight format {name!r}; mk runs {sorted(FORMATS)}") from None
