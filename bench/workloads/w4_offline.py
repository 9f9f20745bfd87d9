"""W4 — offline blend with shared prefixes (BlendServe; synthesis §5.3). BE only.

All requests are submitted at t = 0 in a random order (order_key = position), as one offline job:
* chat-like (BurstGPT-like, compute dense): prompt lognormal 600±600 (16…4K), output
  lognormal 250±250 (1…2K);
* long-output "video-like" (memory dense): prompt U(64,256), output U(2K,6K) — BlendServe
  normalises these to a 16K mean; 4K keeps the simulation short;
* MMLU-like: one of 57 subjects' 5-shot prefix of 1024 tokens (two 512-token blocks, shared by
  every question of the subject) + a question of U(32,160) tokens, output 2 tokens.
5 % of requests are video-like; the MMLU share is solved so that shared-prefix tokens are the
variant's share of all prompt tokens: "p35" (35 %, default) or "p5" (5 %).
Throughput is over the makespan. Full size: 40K requests; default scale 0.1 (4,000).
"""

from __future__ import annotations

import numpy as np

from bench.workloads.base import (
    BuildContext,
    RequestSpec,
    SpecSource,
    Workload,
    WorkloadParams,
    check_variant,
    max_new_for,
)
from bench.workloads.sampling import (
    BLOCK_TOKENS,
    lognormal_ints,
    rng_for,
    stable_hash,
    uniform_ints,
    unique_block_hashes,
)
from bench.workloads.sources import TimedSource

FULL_REQUESTS = 40_000
DEFAULT_SCALE = 0.1
VIDEO_SHARE = 0.05
SUBJECTS = 57
PREFIX_TOKENS = 2 * BLOCK_TOKENS
CHAT_PROMPT, CHAT_OUTPUT = (600.0, 600.0, 16, 4096), (250.0, 250.0, 1, 2048)
VIDEO_PROMPT, VIDEO_OUTPUT = (64, 256), (2048, 6144)
QUESTION, MMLU_OUTPUT = (32, 160), 2
PREFIX_SHARES = {"p35": 0.35, "p5": 0.05}


def mmlu_share(prefix_share: float) -> float:
    """Fraction of requests that are MMLU-like so that shared-prefix tokens make up
    `prefix_share` of all prompt tokens (nominal means; 5 % video-like)."""
    chat, video = CHAT_PROMPT[0], sum(VIDEO_PROMPT) / 2
    question = sum(QUESTION) / 2
    other = VIDEO_SHARE * video + (1 - VIDEO_SHARE) * chat
    return prefix_share * other / (PREFIX_TOKENS - prefix_share * (PREFIX_TOKENS + question - chat))


def _classes(params: WorkloadParams, n: int, prefix_share: float) -> np.ndarray:
    """Class per request: 0 chat, 1 video-like, 2 MMLU-like."""
    f = mmlu_share(prefix_share)
    rng = rng_for(params.seed, "w4", "classes")
    return rng.choice(3, size=n, p=[1 - VIDEO_SHARE - f, VIDEO_SHARE, f])


def requests(params: WorkloadParams, n: int, prefix_share: float) -> list[RequestSpec]:
    """The whole job, in submission order."""
    classes = _classes(params, n, prefix_share)
    rng = rng_for(params.seed, "w4", "lengths")
    chat_p = lognormal_ints(
        rng, CHAT_PROMPT[0], CHAT_PROMPT[1], n, low=CHAT_PROMPT[2], high=CHAT_PROMPT[3]
    )
    chat_o = lognormal_ints(
        rng, CHAT_OUTPUT[0], CHAT_OUTPUT[1], n, low=CHAT_OUTPUT[2], high=CHAT_OUTPUT[3]
    )
    video_p, video_o = uniform_ints(rng, *VIDEO_PROMPT, n), uniform_ints(rng, *VIDEO_OUTPUT, n)
    question, subject = uniform_ints(rng, *QUESTION, n), rng.integers(0, SUBJECTS, n)
    order = rng_for(params.seed, "w4", "order").permutation(n)
    specs: list[RequestSpec] = []
    for position, i in enumerate(order):
        rid = f"be-{i:06d}"
        kind = int(classes[i])
        if kind == 2:
            prompt, output, cap, key = PREFIX_TOKENS + int(question[i]), MMLU_OUTPUT, 2, "mmlu"
            shared = tuple(stable_hash("mmlu", int(subject[i]), b) for b in range(2))
            hashes = shared + unique_block_hashes(rid, prompt, start_block=2)
        else:
            prompt, output, cap, key = (
                (int(chat_p[i]), int(chat_o[i]), CHAT_OUTPUT[3], "chat")
                if kind == 0
                else (int(video_p[i]), int(video_o[i]), 8192, "video")
            )
            hashes = unique_block_hashes(rid, prompt)
        specs.append(
            RequestSpec(
                rid=rid,
                tier="be",
                arrival_s=0.0,
                prompt_len=prompt,
                output_len=output,
                max_new_tokens=max_new_for(params, output, cap),
                length_key=f"w4-{key}",
                order_key=float(position),
                prefix_hashes=hashes,
            )
        )
    return specs


def build(params: WorkloadParams, ctx: BuildContext) -> Workload:
    """W4 as a Workload (BE only, no λ*)."""
    variant = check_variant("W4", params.variant, tuple(PREFIX_SHARES))
    scale = params.scale if params.scale is not None else DEFAULT_SCALE
    n = max(1, round(FULL_REQUESTS * scale))
    share = PREFIX_SHARES[variant]

    def make_source(rate: float | None, include_be: bool) -> SpecSource:
        return TimedSource(requests(params, n, share) if include_be else [])

    return Workload(
        name="W4",
        description=f"offline blend: {n} BE requests (chat, long-output, MMLU-like "
        f"shared prefixes {share:.0%} of prompt tokens)",
        make_source=make_source,
        longest_prompt=CHAT_PROMPT[3],
        window_s=None,
        rt_poisson=None,
        has_rt=False,
        params={
            "requests": n,
            "prefix_share": share,
            "mmlu_share": round(mmlu_share(share), 4),
            "video_share": VIDEO_SHARE,
            "subjects": SUBJECTS,
        },
    )
