"""HiFT vocoder of CosyVoice2: log-mel (1, 80, T) at 50 Hz -> waveform (1, 480 T) at 24 kHz.

Pure torch; runs in float32 (the harmonic phase is accumulated in float32 over the whole input,
so lower precision moves the waveform audibly). Weight norm is folded into plain weights by
``checkpoint.load_hift``; the modules here only hold ordinary ``weight``/``bias`` tensors whose
names match the official ``hift.pt`` after folding.

Pipeline (cosyvoice2-spec.md section 4)::

    mel (B, C_mel, T) --F0Predictor--> f0 (B, T) Hz
    f0 --nearest x S--> f0_up (B, L, 1), L = S T, S = prod(upsample_rates) * istft_hop
    f0_up --HarmonicSource--> source (B, 1, L)      (cache_source overwrites its first samples)
    mel, source --decode--> speech (B, L), clamped to +-audio_limit

Randomness: upstream draws random initial phases (which the down-interpolation never reads) and
additive Gaussian noise on the sines. ``noise=None`` gives the deterministic source used for parity
(zero phase, no noise); passing a ``torch.Generator`` enables the noise, drawn from that generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Fixed by the upstream architecture (they appear in no config file).
CONV_PRE_KERNEL = 7
CONV_POST_KERNEL = 7
F0_KERNEL = 3
F0_NUM_CONVS = 5
SNAKE_EPS = 1e-9
MAX_MAGNITUDE = 100.0
POST_LRELU_SLOPE = 0.01  # leaky_relu default before conv_post (the stages use lrelu_slope)


@dataclass(frozen=True)
class HiFTDims:
    """Hyper-parameters of ``HiFTGenerator`` (the ``hift`` section of ``cosyvoice2.yaml``)."""

    in_channels: int
    base_channels: int
    nb_harmonics: int
    sampling_rate: int
    nsf_alpha: float
    nsf_sigma: float
    nsf_voiced_threshold: float
    upsample_rates: tuple[int, ...]
    upsample_kernel_sizes: tuple[int, ...]
    istft_n_fft: int
    istft_hop: int
    resblock_kernel_sizes: tuple[int, ...]
    resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    source_resblock_kernel_sizes: tuple[int, ...]
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    lrelu_slope: float
    audio_limit: float
    f0_in_channels: int
    f0_cond_channels: int
    f0_num_class: int

    def __post_init__(self) -> None:
        n = len(self.upsample_rates)
        if n == 0 or len(self.upsample_kernel_sizes) != n:
            raise ValueError("hift: upsample_rates and upsample_kernel_sizes must be non-empty and equally long")
        if len(self.source_resblock_kernel_sizes) != n or len(self.source_resblock_dilation_sizes) != n:
            raise ValueError("hift: one source resblock per upsample stage is required")
        if len(self.resblock_kernel_sizes) != len(self.resblock_dilation_sizes):
            raise ValueError("hift: resblock_kernel_sizes and resblock_dilation_sizes differ in length")
        if self.base_channels % (2**n) != 0:
            raise ValueError(f"hift: base_channels {self.base_channels} must be divisible by 2**{n}")
        if self.f0_num_class != 1:
            raise ValueError("hift: the F0 predictor must have num_class 1")
        if self.f0_in_channels != self.in_channels:
            raise ValueError("hift: f0_predictor in_channels must equal the vocoder in_channels")

    @property
    def samples_per_frame(self) -> int:
        """Output samples per mel frame (480 for CosyVoice2)."""
        return math.prod(self.upsample_rates) * self.istft_hop

    @property
    def n_bins(self) -> int:
        return self.istft_n_fft // 2 + 1

    @staticmethod
    def from_config(hift: dict[str, Any]) -> HiFTDims:
        """Build from the kwargs of the ``hift: !new:...HiFTGenerator`` node of the yaml."""

        def need(key: str, src: dict[str, Any] = hift, where: str = "hift") -> Any:
            if key not in src:
                raise KeyError(f"cosyvoice2.yaml: {where}.{key} is missing")
            return src[key]

        istft = need("istft_params")
        f0p = need("f0_predictor")
        f0_kwargs: dict[str, Any] = getattr(f0p, "kwargs", f0p)
        return HiFTDims(
            in_channels=int(need("in_channels")),
            base_channels=int(need("base_channels")),
            nb_harmonics=int(need("nb_harmonics")),
            sampling_rate=int(need("sampling_rate")),
            nsf_alpha=float(need("nsf_alpha")),
            nsf_sigma=float(need("nsf_sigma")),
            nsf_voiced_threshold=float(need("nsf_voiced_threshold")),
            upsample_rates=tuple(int(v) for v in need("upsample_rates")),
            upsample_kernel_sizes=tuple(int(v) for v in need("upsample_kernel_sizes")),
            istft_n_fft=int(need("n_fft", istft, "hift.istft_params")),
            istft_hop=int(need("hop_len", istft, "hift.istft_params")),
            resblock_kernel_sizes=tuple(int(v) for v in need("resblock_kernel_sizes")),
            resblock_dilation_sizes=tuple(tuple(int(d) for d in ds) for ds in need("resblock_dilation_sizes")),
            source_resblock_kernel_sizes=tuple(int(v) for v in need("source_resblock_kernel_sizes")),
            source_resblock_dilation_sizes=tuple(
                tuple(int(d) for d in ds) for ds in need("source_resblock_dilation_sizes")
            ),
            lrelu_slope=float(hift.get("lrelu_slope", 0.1)),
            audio_limit=float(hift.get("audio_limit", 0.99)),
            f0_in_channels=int(need("in_channels", f0_kwargs, "hift.f0_predictor")),
            f0_cond_channels=int(need("cond_channels", f0_kwargs, "hift.f0_predictor")),
            f0_num_class=int(f0_kwargs.get("num_class", 1)),
        )


# --------------------------------------------------------------------------------------------
# Building blocks


class Snake(nn.Module):
    """x + sin^2(alpha x) / (alpha + 1e-9), alpha a per-channel vector in linear scale.

    The reference form; the fast path swaps in one fused kernel (``voice_out.fast.fused_vocoder``)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: Tensor) -> Tensor:  # x: [B, C, T]
        alpha = self.alpha[None, :, None]
        return x + (1.0 / (alpha + SNAKE_EPS)) * torch.sin(x * alpha).pow(2)


class ResBlock(nn.Module):
    """Snake -> dilated conv -> Snake -> conv, residual, once per dilation."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel_size, dilation=d, padding=d * (kernel_size - 1) // 2)
            for d in dilations
        )
        self.convs2 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel_size, padding=(kernel_size - 1) // 2) for _ in dilations
        )
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: Tensor) -> Tensor:  # [B, C, T] -> [B, C, T]
        for c1, c2, a1, a2 in zip(self.convs1, self.convs2, self.activations1, self.activations2, strict=True):
            x = x + c2(a2(c1(a1(x))))
        return x


class F0Predictor(nn.Module):
    """5 x (Conv1d k3 + ELU), Linear to one value per frame, absolute value: f0 in Hz."""

    def __init__(self, in_channels: int, cond_channels: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(F0_NUM_CONVS):
            c_in = in_channels if i == 0 else cond_channels
            layers += [nn.Conv1d(c_in, cond_channels, F0_KERNEL, padding=F0_KERNEL // 2), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, 1)

    def forward(self, mel: Tensor) -> Tensor:  # [B, C_mel, T] -> [B, T]
        h = self.condnet(mel).transpose(1, 2)  # [B, T, C]
        return torch.abs(self.classifier(h).squeeze(-1))


class HarmonicSource(nn.Module):
    """SineGen2 + SourceModuleHnNSF: f0 at the sample rate -> excitation (B, 1, L).

    The phase follows upstream step by step: per-sample increments (k f0 / sr) mod 1, linear
    down-interpolation by scale 1/S (PyTorch semantics), cumulative sum, x 2 pi, x S, linear
    up-interpolation by scale S. Only the learned Linear(nb_harmonics + 1 -> 1) has weights.
    """

    harmonics: Tensor  # [nb_harmonics + 1] = 1, 2, ..., nb_harmonics + 1

    def __init__(self, dims: HiFTDims) -> None:
        super().__init__()
        self.dims = dims
        self.l_linear = nn.Linear(dims.nb_harmonics + 1, 1)
        self.register_buffer("harmonics", torch.arange(1, dims.nb_harmonics + 2, dtype=torch.float32), persistent=False)

    def forward(self, f0_up: Tensor, noise: torch.Generator | None = None) -> Tensor:
        """f0_up: [B, L, 1] Hz (nearest-upsampled) -> source [B, 1, L]."""
        d = self.dims
        scale = float(d.samples_per_frame)
        fn = f0_up * self.harmonics  # [B, L, H]
        rad = (fn / d.sampling_rate) % 1.0
        if noise is not None:
            # Random initial phases (fundamental fixed at 0). Sample 0 is never read by the
            # down-interpolation below, so this only keeps the draw order of upstream.
            ini = torch.rand(fn.shape[0], fn.shape[2], generator=noise, device=fn.device, dtype=fn.dtype)
            ini[:, 0] = 0.0
            rad[:, 0, :] = rad[:, 0, :] + ini
        rad_frames = F.interpolate(rad.transpose(1, 2), scale_factor=1.0 / scale, mode="linear")  # [B, H, T]
        phase = torch.cumsum(rad_frames, dim=2) * (2.0 * math.pi)
        phase = F.interpolate(phase * scale, scale_factor=scale, mode="linear").transpose(1, 2)  # [B, L, H]
        sines = d.nsf_alpha * torch.sin(phase)
        uv = (f0_up > d.nsf_voiced_threshold).to(sines.dtype)  # [B, L, 1]
        e = sines * uv
        if noise is not None:
            amp = uv * d.nsf_sigma + (1.0 - uv) * (d.nsf_alpha / 3.0)
            e = e + amp * torch.randn(sines.shape, generator=noise, device=sines.device, dtype=sines.dtype)
        return torch.tanh(self.l_linear(e)).transpose(1, 2)


# --------------------------------------------------------------------------------------------
# The vocoder


def istft(spec: Tensor, n_fft: int, hop: int, window: Tensor) -> Tensor:
    """``torch.istft(spec, n_fft, hop, n_fft, window, center=True)`` by windowed overlap-add.

    spec complex ``[B, n_fft // 2 + 1, N]`` -> float ``[B, hop * (N - 1)]``. Same arithmetic as
    torch's, without its input check that copies a value to the host (which a CUDA graph
    cannot contain).
    """
    n_frames = spec.shape[2]
    frames = torch.fft.irfft(spec, n=n_fft, dim=1) * window[None, :, None]  # [B, n_fft, N]
    full = n_fft + hop * (n_frames - 1)
    fold = {"output_size": (1, full), "kernel_size": (1, n_fft), "stride": (1, hop)}
    signal = F.fold(frames, **fold)[:, 0, 0]  # [B, full]
    envelope = F.fold((window * window)[None, :, None].expand(1, n_fft, n_frames), **fold)[0, 0, 0]
    half = n_fft // 2
    return signal[:, half : full - half] / envelope[half : full - half]


class HiFT(nn.Module):
    """HiFTGenerator (NSF + iSTFT HiFi-GAN) with folded weight norm. Module names match hift.pt."""

    stft_window: Tensor  # [n_fft] periodic Hann, float32 (not in the state dict)

    def __init__(self, dims: HiFTDims) -> None:
        super().__init__()
        self.dims = dims
        n_up = len(dims.upsample_rates)
        c0 = dims.base_channels
        src_ch = dims.istft_n_fft + 2  # [real; imag] of n_fft/2 + 1 bins
        self.f0_predictor = F0Predictor(dims.f0_in_channels, dims.f0_cond_channels)
        self.m_source = HarmonicSource(dims)
        self.conv_pre = nn.Conv1d(dims.in_channels, c0, CONV_PRE_KERNEL, padding=CONV_PRE_KERNEL // 2)
        self.ups = nn.ModuleList(
            nn.ConvTranspose1d(c0 // 2**i, c0 // 2 ** (i + 1), k, stride=u, padding=(k - u) // 2)
            for i, (u, k) in enumerate(zip(dims.upsample_rates, dims.upsample_kernel_sizes, strict=True))
        )
        # The source STFT runs at the last stage's rate; stage i sees it downsampled by the product
        # of the later stages' rates (15, 3, 1 for [8, 5, 3]).
        down_rates = [math.prod(dims.upsample_rates[i + 1 :]) for i in range(n_up)]
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (r, k, ds) in enumerate(
            zip(down_rates, dims.source_resblock_kernel_sizes, dims.source_resblock_dilation_sizes, strict=True)
        ):
            ch = c0 // 2 ** (i + 1)
            if r == 1:
                self.source_downs.append(nn.Conv1d(src_ch, ch, 1))
            else:
                self.source_downs.append(nn.Conv1d(src_ch, ch, 2 * r, stride=r, padding=r // 2))
            self.source_resblocks.append(ResBlock(ch, k, ds))
        self.resblocks = nn.ModuleList(
            ResBlock(c0 // 2 ** (i + 1), k, ds)
            for i in range(n_up)
            for k, ds in zip(dims.resblock_kernel_sizes, dims.resblock_dilation_sizes, strict=True)
        )
        self.conv_post = nn.Conv1d(c0 // 2**n_up, src_ch, CONV_POST_KERNEL, padding=CONV_POST_KERNEL // 2)
        # Periodic Hann, computed in float64 and stored in float32 (as scipy's window would be).
        window = torch.hann_window(dims.istft_n_fft, periodic=True, dtype=torch.float64).to(torch.float32)
        self.register_buffer("stft_window", window, persistent=False)

    # -- pieces --------------------------------------------------------------------------------

    def predict_f0(self, mel: Tensor) -> Tensor:
        """mel [B, C_mel, T] -> f0 [B, T] in Hz."""
        return self.f0_predictor(mel)

    def source(self, f0: Tensor, noise: torch.Generator | None = None) -> Tensor:
        """f0 [B, T] -> excitation [B, 1, S T]."""
        f0_up = F.interpolate(f0[:, None, :], scale_factor=float(self.dims.samples_per_frame), mode="nearest")
        return self.m_source(f0_up.transpose(1, 2), noise)

    def decode(self, mel: Tensor, source: Tensor) -> Tensor:
        """mel [B, C_mel, T], source [B, 1, S T] -> speech [B, S T], clamped."""
        d = self.dims
        n_fft, hop = d.istft_n_fft, d.istft_hop
        spec = torch.stft(
            source.squeeze(1), n_fft, hop, n_fft, window=self.stft_window, center=True, return_complex=True
        )
        spec_ri = torch.view_as_real(spec)  # [B, F, frames, 2]
        s = torch.cat([spec_ri[..., 0], spec_ri[..., 1]], dim=1)  # [B, 2F, frames]

        x = self.conv_pre(mel)
        n_up = len(self.ups)
        n_k = len(d.resblock_kernel_sizes)
        for i in range(n_up):
            x = F.leaky_relu(x, d.lrelu_slope)
            x = self.ups[i](x)
            if i == n_up - 1:
                x = F.pad(x, (1, 0), mode="reflect")
            x = x + self.source_resblocks[i](self.source_downs[i](s))
            acc = self.resblocks[i * n_k](x)
            for j in range(1, n_k):
                acc = acc + self.resblocks[i * n_k + j](x)
            x = acc / n_k
        x = F.leaky_relu(x, POST_LRELU_SLOPE)
        x = self.conv_post(x)
        nb = d.n_bins
        magnitude = torch.clamp(torch.exp(x[:, :nb, :]), max=MAX_MAGNITUDE)
        phase = torch.sin(x[:, nb:, :])
        spec_out = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
        speech = istft(spec_out, n_fft, hop, self.stft_window)
        return torch.clamp(speech, -d.audio_limit, d.audio_limit)

    # -- whole model ---------------------------------------------------------------------------

    def forward(
        self,
        mel: Tensor,
        cache_source: Tensor | None = None,
        noise: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        """mel [B, C_mel, T] (float32) -> (speech [B, S T], source [B, 1, S T]).

        ``cache_source`` [B, 1, n] (n <= S T) overwrites the first n source samples, keeping the
        excitation continuous across streaming chunks. ``noise`` None = deterministic source.
        """
        f0 = self.predict_f0(mel)
        source = self.source(f0, noise)
        if cache_source is not None and cache_source.shape[2] > 0:
            n = cache_source.shape[2]
            source = torch.cat([cache_source.to(source.dtype), source[:, :, n:]], dim=2)
        return self.decode(mel, source), source
