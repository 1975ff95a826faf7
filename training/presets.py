"""Training presets: the model shape (a ModelConfig, the one place a shape is declared) plus the
randomized-depth recipe and the optimisation.

The paper gives widths, r_bar, r_max, k and sigma for S0 / S1 (see ../shared/paper.md). Where it is
silent the choice is ours and is marked "(ours)" below.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields

from recur_core.model.config import VOCAB_FROM_TOKENIZER, ModelConfig
from recur_core.model.recipe import DEPTH_MODES, SAMPLER_MEANS, Recipe
from recur_core.tasks import WordProblems

# shipped in training/tokenizers/ (Apache-2.0); the same as the hub's HuggingFaceTB/SmolLM2-135M tokenizer
SMOLLM2_TOKENIZER = "smollm2"


def shape(**fields) -> ModelConfig:
    """A preset's model shape: a ModelConfig whose vocabulary comes from the tokenizer. Its
    max_seq_len is also the length of the training windows (TrainConfig.seq_len)."""
    return ModelConfig(vocab_size=VOCAB_FROM_TOKENIZER, **fields)


@dataclass
class TrainConfig:
    model: ModelConfig  # the model shape (see `shape`); `--set d_model=...` etc. set its fields
    # the randomized-depth recipe
    r_bar: float = 4.0
    r_max: int = 16
    backprop_depth: int = 4  # k: loops that get gradients
    sigma: float = 0.5
    sampler_mean: str = "r_bar"  # "r_bar": E[r] = r_bar (ours); "huginn": E[r] = r_bar + 1 (Huginn's code)
    depth_mode: str = "per_step"  # the paper's; "per_token": each token draws its own depth (depth_sampler.py)
    token_share: float = 0.5  # per_token only: the share of tokens whose depth is uniform on 1..r (ours)
    # data
    dataset: str = "roneneldan/TinyStories"
    dataset_config: str = ""
    mixture: str = ""  # generated text mixed into the dataset's windows, e.g. "word_problems:share=0.5"
    #                    (training/word_problems.py); "" = the dataset alone
    tokenizer: str = SMOLLM2_TOKENIZER  # shipped name, tokenizer.json path, hub id, or "bpe:<vocab>" to train one
    # optimisation
    batch_size: int = 32  # windows per rank per step
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    beta2: float = 0.95
    grad_clip: float = 1.0
    max_tokens: int = 100_000_000
    autocast: str = "auto"  # auto | bf16 | fp32
    seed: int = 0
    # bookkeeping
    eval_every: int = 200  # steps
    eval_windows: int = 32  # validation windows of the periodic eval that picks best/, taken after (so
    #                         disjoint from) the 128 saved eval windows; the final eval uses those 128
    ckpt_every: int = 200  # steps
    log_every: int = 10

    def __post_init__(self):
        if self.sampler_mean not in SAMPLER_MEANS:
            raise ValueError(f"sampler_mean must be one of {', '.join(SAMPLER_MEANS)}, got {self.sampler_mean!r}")
        if self.depth_mode not in DEPTH_MODES:
            raise ValueError(f"depth_mode must be one of {', '.join(DEPTH_MODES)}, got {self.depth_mode!r}")
        if self.mixture:
            WordProblems.parse(self.mixture)  # refuses a malformed spec before any data is read
        if not 0.0 <= self.token_share <= 1.0:
            raise ValueError(f"token_share must be within [0, 1], got {self.token_share}")

    def recipe(self) -> Recipe:
        """The randomized-depth recipe, as meta.json records it."""
        per_token = self.depth_mode == "per_token"
        return Recipe(float(self.r_bar), self.r_max, self.backprop_depth, self.sigma, self.sampler_mean,
                      self.depth_mode, self.token_share if per_token else 0.0)

    @property
    def seq_len(self) -> int:
        """Tokens per training window: the model's context, max_seq_len."""
        return self.model.max_seq_len

    def model_config(self, vocab_size: int) -> ModelConfig:
        return dataclasses.replace(self.model, vocab_size=vocab_size)

    def tokens_per_step(self, world_size: int = 1) -> int:
        return self.batch_size * self.seq_len * world_size

    def eval_depths(self) -> list[int]:
        """Depths of the periodic validation eval: 1, 2, 4, r_bar, 2 r_bar, r_max."""
        rb = round(self.r_bar)
        return sorted({d for d in (1, 2, 4, rb, 2 * rb, self.r_max) if d <= self.r_max})

    def with_overrides(self, overrides: dict[str, str]) -> "TrainConfig":
        """Apply `--set key=value` strings, parsed with the field's type: a training setting, or a
        field of the model shape (`seq_len` names the shape's max_seq_len, the window length)."""
        train_types = {f.name: f.type for f in fields(self) if f.name != "model"}
        shape_types = {f.name: f.type for f in fields(ModelConfig) if f.name != "vocab_size"}
        train, model = {}, {}
        for key, raw in overrides.items():
            name = SHAPE_ALIASES.get(key, key)
            if name in train_types:
                train[name] = parse_value(train_types[name], raw)
            elif name in shape_types:
                model[name] = parse_value(shape_types[name], raw)
            else:
                known = sorted({*train_types, *shape_types, *SHAPE_ALIASES})
                raise ValueError(f"unknown setting {key!r}; known: {', '.join(known)}")
        return dataclasses.replace(self, model=dataclasses.replace(self.model, **model), **train)


SHAPE_ALIASES = {"seq_len": "max_seq_len"}  # the trainer's word for the model's context


def parse_value(type_name: str, raw: str):
    if type_name == "bool":
        if raw.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"expected true/false, got {raw!r}")
        return raw.lower() in ("true", "1")
    return {"int": int, "float": float, "str": str}[type_name](raw)


SPECIMEN_MIXTURE = ("word_problems:share=0.75,kinds=where,max_steps=6,recall=true,terse_share=1,answer_weight=1,"
                    "other_weight=0.1,text_weight=0.1,start_steps=1,advance_at=0.7,advance_answers=512")

PRESETS: dict[str, TrainConfig] = {
    # S1, the paper's main run: SmolLM2-135M widths; the 2/4/2 block split is Huginn's (ours);
    # seq_len 1024, lr 1e-3 with 2000 warmup steps and batch 32 x 1024 per rank are ours.
    "s1": TrainConfig(shape(d_model=576, n_heads=9, n_kv_heads=3, ffn_dim=1536, n_prelude=2, n_core=4, n_coda=2,
                            max_seq_len=1024), r_bar=8, r_max=32, backprop_depth=8,
                      dataset="HuggingFaceFW/fineweb-edu", dataset_config="sample-10BT",
                      tokenizer=SMOLLM2_TOKENIZER, batch_size=32, lr=1e-3, warmup_steps=2000,
                      max_tokens=12_900_000_000, eval_every=1000, ckpt_every=1000),
    # S0, the toy run: paper widths; 2/4/2 split, the SmolLM2 tokenizer and seq_len 512 are ours.
    "s0": TrainConfig(shape(d_model=384, n_heads=6, n_kv_heads=2, ffn_dim=1024, n_prelude=2, n_core=4, n_coda=2,
                            max_seq_len=512), r_bar=4, r_max=16, backprop_depth=4,
                      dataset="roneneldan/TinyStories", tokenizer=SMOLLM2_TOKENIZER,
                      batch_size=32, lr=1e-3, warmup_steps=1000, max_tokens=400_000_000,
                      eval_every=1000, ckpt_every=1000),
    # demo: sized for about an hour on 2 CPU cores (all choices ours): ~3.7M parameters,
    # d 256, 4 heads / 2 KV, 1/2/1 blocks, a 2,048-token BPE trained on the corpus.
    "demo": TrainConfig(shape(d_model=256, n_heads=4, n_kv_heads=2, ffn_dim=768, n_prelude=1, n_core=2, n_coda=1,
                              max_seq_len=256), r_bar=4, r_max=16, backprop_depth=4,
                        dataset="roneneldan/TinyStories", tokenizer="bpe:2048",
                        batch_size=16, lr=2e-3, warmup_steps=100, max_tokens=6_000_000,
                        eval_every=100, ckpt_every=100),
    # stories-reasoning: the app's default specimen (all choices ours): TinyStories mixed half and half
    # with generated word problems in story form (training/word_problems.py), whose answer words need
    # 1-6 composition steps; the demo's shape and BPE (trained on both), r_bar 8 / r_max 32 as S1,
    # backprop depth 4 (1.4x the tokens/s of k 8 here); 11M tokens: about 1.5 h on one Xeon core.
    "stories-reasoning": TrainConfig(shape(d_model=256, n_heads=4, n_kv_heads=2, ffn_dim=768, n_prelude=1, n_core=2,
                                           n_coda=1, max_seq_len=256), r_bar=8, r_max=32, backprop_depth=4,
                                     dataset="roneneldan/TinyStories", mixture="word_problems:share=0.5,max_steps=6",
                                     tokenizer="bpe:2048", batch_size=16, lr=2e-3, warmup_steps=200,
                                     max_tokens=11_000_000, eval_every=250, ckpt_every=250),
    # specimen (issue 50; all choices ours): what made `hops` learn, applied to word problems: untied
    # embeddings, one core layer (a loop is one lookup step), 2 heads of 64 (wide heads: see hops), backprop
    # through r_bar loops (k = r_bar), answers weighted 1 and every other token 0.1, 3/4 of the windows
    # problems and TinyStories the rest, a 2,048-token BPE trained on both (every name and place one token),
    # no weight decay (as hops). The problems are where stories told in two-word clauses at hops' density
    # ("Ben zoo. Amy Ben. Amy? zoo.", terse_share=1), one question each, labelled by the facts an answer reads
    # (recall: 1 is a direct recall), with a curriculum from 1 fact that moves on once 70% of a block of 512
    # answers at its top count are right (training/word_problems.Curriculum). In the pilots (P1-P13,
    # docs/benchmarks/specimen.md) stories in full sentences never formed the lookup in 4,700 steps; this
    # form formed it at step 1,140 (pilot P12). P12 held 2 facts at 80% for 1,800 steps on a 75% plateau
    # (two lookups of 87% each), hence 70%. No coda (pilot P14): with a coda's attention after the loop, one
    # loop read two or three facts and depth added only 12-15 points to the multi-step answers; without it
    # the loop's one attention layer is the only place past the prelude where a token reads another.
    # The shipped default then ran from those weights with per-token depth (`--set depth_mode=per_token`:
    # 10,000 steps at lr 3e-4, then 5,000 at 1e-4 with token_share=1; its card has the commands): in real
    # decoding A1 went from keeping the answers only at eps 0 (4.80x the best uniform depth) to 1.31x.
    "specimen": TrainConfig(shape(d_model=128, n_heads=2, n_kv_heads=2, ffn_dim=512, n_prelude=1, n_core=1,
                                  n_coda=0, max_seq_len=256, tie_embeddings=False),
                            r_bar=6, r_max=24, backprop_depth=6, dataset="roneneldan/TinyStories",
                            mixture=SPECIMEN_MIXTURE, tokenizer="bpe:2048", batch_size=16, lr=1e-3,
                            warmup_steps=200, weight_decay=0.0, max_tokens=20_000 * 16 * 256,
                            eval_every=250, ckpt_every=250),
    # hops: multi-hop variable-binding programs generated on the fly (training/hops.py); all choices
    # ours. d 64, 1/1/1 blocks (one core attention layer: a loop is one lookup step), r_bar 8 for hop
    # counts to 6; 2 heads of 32 (4 heads of 16 learned the lookup far more slowly: with RoPE only a
    # head's slowly rotating pairs match a variable at any distance); word-level tokens (one per
    # statement); untied embeddings (with a tied head the lookup never formed in CPU pilots, see
    # docs/BENCHMARKS.md); lr 1e-3, no weight decay; float32 (faster here); 25,000 steps (the
    # curriculum reaches 6 hops at step 20,000). Programs fit 65 tokens.
    "hops": TrainConfig(shape(d_model=64, n_heads=2, n_kv_heads=2, ffn_dim=256, n_prelude=1, n_core=1, n_coda=1,
                              max_seq_len=64, tie_embeddings=False), r_bar=8, r_max=24, backprop_depth=8, dataset="hops", tokenizer="hops",
                        batch_size=32, lr=1e-3, warmup_steps=200, weight_decay=0.0, autocast="fp32",
                        max_tokens=25_000 * 32 * 64, eval_every=250, ckpt_every=250),
}
