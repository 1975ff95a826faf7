"""The randomized-depth recipe a checkpoint was trained with, read from meta.json in one place.

meta.json's "recipe" holds r_bar (mean loops per step), r_max (the sampler's cap), k (loops that get
gradients), sigma (the log-normal's spread) and sampler_mean (what the sampler's mean is:
"r_bar", E[r] = r_bar, ours; or "huginn", E[r] = r_bar + 1, Huginn's code).

One fallback rule for a field a checkpoint does not record (absent or null): take it from the paper's configuration
table, where r_max = 4 r_bar, k = r_bar and sigma = 0.5 at both scales (S0: 4 / 16 / 4, S1:
8 / 32 / 8); with neither r_bar nor r_max, the S1 recipe. sampler_mean defaults to "r_bar", the only
sampler this project used before the field was recorded. `defaulted` names the fields so filled.

depth_mode says who draws the depth: "per_step" (the paper's recipe: every token of a step runs the
step's r) or "per_token" (each token draws its own, training/depth_sampler.py; token_share is the
share of tokens that draw below r). A meta.json without it predates the option, so it is "per_step"
and not a fallback.
"""
from __future__ import annotations

from dataclasses import dataclass

SAMPLER_MEANS = ("r_bar", "huginn")
DEPTH_MODES = ("per_step", "per_token")
PAPER_R_MAX_PER_R_BAR = 4  # S0: 16 / 4, S1: 32 / 8
PAPER_SIGMA = 0.5
PAPER_S1_R_BAR = 8.0


@dataclass(frozen=True)
class Recipe:
    r_bar: float  # mean loops per training step
    r_max: int  # cap on the loops drawn
    k: int  # truncated backprop: loops that get gradients
    sigma: float  # spread of the log-normal rate
    sampler_mean: str = "r_bar"  # "r_bar": E[r] = r_bar; "huginn": E[r] = r_bar + 1
    depth_mode: str = "per_step"  # "per_step": every token runs the step's r; "per_token": each its own
    token_share: float = 0.0  # per_token: the share of tokens whose depth is uniform on 1..r
    defaulted: tuple[str, ...] = ()  # fields not in meta.json, filled by the fallback rule

    def __post_init__(self):
        if self.sampler_mean not in SAMPLER_MEANS:
            raise ValueError(f"sampler_mean must be one of {SAMPLER_MEANS}, got {self.sampler_mean!r}")
        if self.depth_mode not in DEPTH_MODES:
            raise ValueError(f"depth_mode must be one of {DEPTH_MODES}, got {self.depth_mode!r}")
        if self.r_bar < 1 or self.r_max < 1:
            raise ValueError(f"a recipe needs r_bar >= 1 and r_max >= 1, got {self.r_bar}, {self.r_max}")

    @classmethod
    def from_meta(cls, meta: dict | None) -> "Recipe":
        rec = {k: v for k, v in ((meta or {}).get("recipe") or {}).items() if v is not None}
        given = set(rec)
        if "r_bar" not in rec:
            rec["r_bar"] = rec["r_max"] / PAPER_R_MAX_PER_R_BAR if "r_max" in rec else PAPER_S1_R_BAR
        if "r_max" not in rec:
            rec["r_max"] = round(PAPER_R_MAX_PER_R_BAR * float(rec["r_bar"]))
        rec.setdefault("k", max(1, round(float(rec["r_bar"]))))
        rec.setdefault("sigma", PAPER_SIGMA)
        rec.setdefault("sampler_mean", "r_bar")
        fields = ("r_bar", "r_max", "k", "sigma", "sampler_mean")
        return cls(float(rec["r_bar"]), int(rec["r_max"]), int(rec["k"]), float(rec["sigma"]),
                   str(rec["sampler_mean"]), str(rec.get("depth_mode", "per_step")),
                   float(rec.get("token_share", 0.0)), defaulted=tuple(f for f in fields if f not in given))

    @property
    def depth(self) -> int:
        """r_bar as a whole loop count within 1..r_max: the uniform depth policies are matched to."""
        return max(1, min(round(self.r_bar), self.r_max))

    def to_meta(self) -> dict:
        """meta.json's "recipe" entry."""
        return {"r_bar": self.r_bar, "r_max": self.r_max, "k": self.k, "sigma": self.sigma,
                "sampler_mean": self.sampler_mean, "depth_mode": self.depth_mode, "token_share": self.token_share}

    def describe(self) -> str:
        """One line for cards and captions, naming the fields the fallback rule filled."""
        text = (f"r̄ {self.r_bar:g}, r_max {self.r_max}, backprop depth k {self.k}, σ {self.sigma:g}, "
                f"sampler mean {self.sampler_mean!r}")
        if self.depth_mode == "per_token":
            text += f", per-token depth ({self.token_share:.0%} of tokens draw theirs uniformly from 1..r)"
        if self.defaulted:
            text += f" ({', '.join(self.defaulted)}: not in meta.json, by the fallback rule)"
        return text
