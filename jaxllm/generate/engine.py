"""The rollout engine: a paged KV cache, continuous batching and shared prompts, on one device or a training mesh.

Pages. Each block kind's keys and values live in pools of fixed-size pages [kv_heads, shards, repeats, n_pages,
page, head_dim] (heads first, as the paged kernels read them, one pool per data-parallel shard of the slots, and a
shard's pages of every repeat one pool the kernel reads in place; latent attention's rows [shards, repeats,
n_pages, page, r + d_r]), and each of the engine's S slots holds a page table: its request's page ids in order in
its shard's pool (`attention.CacheView.pages`), so the request's token at position j is in page table[j // page]
at offset j % page. A request gets ⌈(prompt + max_new) / page⌉ pages when it is admitted and gives them back when
it ends; a pool's page 0 is scratch, where padding and idle slots write. A decode step attends over a slot's
pages: on a GPU, where it fits, by JAX's Pallas paged-attention kernel (`ops/paged_attention.py`), elsewhere
gathered in order (XLA's gather) with the training mask by position, so a windowed layer masks as it does in
training (and, as in the static engine, keeps its pages) and the latent cache keeps its small rows.

The rollout layout. The weights are copied once, when the engine is built, into the compute dtype with each
layer's weights arrays of their own (`transformer.per_repeat`: the layers run unrolled and read them in place,
where a layer scan copies each layer's slice of the stack at every step); on a mesh (`on`) resharded into
`cache.generation_layout` (split over tp, whole over fsdp and pp). The slots are split over the
data axes (dp, fsdp, ep: B shards of S / B slots) and so are the pools, heads over tp: each shard's slots take pages
from its own pool only, so a slot's pages are where its row is, a device holds 1 / B of the pages (the pool grows
with the data-parallel ranks), and a decode step reads and writes pages with no collective.
Over several processes (jax.distributed) each process runs the host side alike: the host's inputs go in as global
arrays and what it reads (a call's tokens, a first token) is whole on every device, so every process reads the
same tokens and makes the same scheduling decisions.

Shared prompts. Requests with the same prompt share its prefill: the prompt's full pages are prefilled once (per
shard that runs one of its requests) and referenced by every such request; the page holding its last, partial
page is copied for each (copy-on-write: the completions write their first tokens there), so G completions of a
P-token prompt in one shard hold ⌈P / page⌉ pages of prompt tokens, + G where P is not a multiple of the page. A
page is freed when no request holds it. A request takes a free slot in a shard where its prompt is prefilled
before any other. A shard's pool holds by default what its slots' longest requests need at once (`pool_pages`);
given fewer (`pages`), the next request waits while its shard lacks its pages.

Scheduling (host-driven continuous batching). While requests wait and a slot is free (in a shard with the next
one's pages), the next one (in the order given) is admitted: its slot and pages taken; then the prompts admitted
are prefilled by separate calls (one program per power-of-two prompt bucket, a row per shard: each call prefills
a prompt of that bucket in every shard that has one; a shared prompt's prefill is reused, the head run on each
prompt's last token alone) and each request's first token sampled; then one decode step runs every busy slot at
its own position, and a request that stops (a stop id, or `max_new` tokens) frees its slot for the next at once.
Separate prefill calls rather than prefill chunks inside the decode step: one decode program of one shape, and
GRPO's prompts are short beside their completions. With `steps_per_call` = k one call runs k decode steps (the
tokens fed back on the device) and the host schedules once per k steps.

Overlap (`overlap`, the default; SGLang's overlap scheduler). The host sends each decode call before it reads the
previous call's tokens, so its scheduling (and the next program's launch) runs while the device decodes. What a
call needs from the last one stays on the device (each slot's next token; a request's first token is drawn into
its slot there); positions, steps and tokens left the host knows without reading anything, so a request whose
last wanted token a call draws frees its slot for the very next call. A stop id is seen one call late: the
request ran one more call in its own pages, whose tokens are dropped, and its slot takes the next request a call
later. Pages given back may be written by a call already sent; the device runs calls in the order sent, so that
write lands before any later request's prefill or decode writes there.

Sampling. Request i's token t is drawn with the key fold_in(fold_in(key(seed), t), i): what the static engine
(`decode.py`) draws for the row at place i, so the engine's tokens do not depend on its slot, the order of
arrival or its neighbours, and equal the static engine's where the logits agree to the margin a draw needs.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxllm.errors import ConfigError
from jaxllm.generate.cache import init_cache, layout_for, padded_rows
from jaxllm.generate.decode import (Completion, _dropless, _gathered_weights, bucket, limits_checked,
                                    put_host_arrays)
from jaxllm.generate.sampling import sample
from jaxllm.models import transformer
from jaxllm.models.attention import CacheView, head_dim
from jaxllm.models.layers import matmul_precision
from jaxllm.ops import paged_attention
from jaxllm.sharding import constrain, logical_spec, use_layout
from jaxllm.stack import has_linear


def _keys(seed, steps, indices):
    """One key per row: fold_in(fold_in(key(seed), step), index), as `decode._draw`."""
    base = jax.random.key(seed)
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.fold_in(base, s), i))(steps, indices)


def _view(positions, active, pages, page: int, kernel) -> CacheView:
    """The slots of rows whose tokens sit at `positions` [rows, t] (`active` [rows, t]: 0 for padding): slot j
    of a row at position j, seen where it is at or before the row's last position; `kernel` (kernel, interpret)."""
    slots = pages.shape[1] * page
    index = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), (pages.shape[0], slots))
    last = jnp.max(jnp.where(active > 0, positions, -1), axis=1, keepdims=True)
    return CacheView(None, None, 0, 0, index, (index <= last).astype(jnp.int32), pages, *kernel)


def _hidden(p, pools, tokens, positions, active, pages, m, dtype, page: int, kernel=(None, False)):
    """The last layer's output [rows, t, d] for tokens at positions, their keys and values written into their
    pages."""
    x = transformer.embed(p, tokens, positions, m, dtype)
    view = _view(positions, active, pages, page, kernel)
    return transformer.cached_blocks(p["blocks"], pools, x, positions, active, view, m, dtype)


def _logits(p, x, m, dtype):
    """fp32 logits over the vocabulary for the last layer's output x."""
    return transformer.head_logits(p, x, m, dtype)[..., :m.vocab_size]


def _prefill(w, pools, tokens, lengths, pages, *, m, dtype, page: int):
    """Prompts into their pages, one a row of tokens [rows, bucket] (right-padded after `lengths` [rows] tokens; a
    row per shard, written into that shard's pool; a row of length 0 idle): (pools, each row's last prompt
    token's logits [rows, vocab]). The head runs on the last token alone (not on every position of the bucket)."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    active = (positions < lengths[:, None]).astype(jnp.int32)
    with matmul_precision(dtype):
        x, pools = _hidden(w, pools, tokens, positions, active, pages, m, dtype, page)
        logits = transformer.head_logits_at(w, x, jnp.maximum(lengths - 1, 0), m, dtype)[:, :m.vocab_size]
    return pools, _whole(logits)


def _whole(x):
    """`x` whole on every device (what the host reads: every process reads it all, and schedules alike)."""
    return constrain(x, ())


def _first(logits, row, seed, index, settings, tokens, slot):
    """Request `index` draws its first token from its prompt's last logits (row `row` of a prefill call's), written
    into `tokens`[slot] (what the next decode call feeds each slot, kept on the device): (tokens, the token, its
    log-probability)."""
    token, logp = sample(logits[row][None], _keys(seed, jnp.zeros((1,), jnp.int32), index[None]), *settings)
    return constrain(tokens.at[slot].set(token[0]), ("batch",)), _whole(token[0]), _whole(logp[0])


def slot_inputs(positions, active, steps, indices, left, table) -> np.ndarray:
    """A decode call's inputs of every slot [S] as one int32 array [S, 5 + table width] (one transfer a call, not
    six): its position, whether it is busy, its step, its request's index, its tokens still wanted, then its page
    table [S, width]."""
    return np.concatenate([np.stack([positions, active, steps, indices, left], axis=1), table], axis=1, dtype=np.int32)


def _decode(w, pools, tokens, inputs, seed, settings, *, m, dtype, page: int, kernel, steps_per_call: int):
    """`steps_per_call` tokens for every slot (idle ones compute on scratch), each step's token fed to the next, the
    slots' `inputs` as `slot_inputs` packs them: (pools, tokens [steps_per_call, S], logprobs [steps_per_call, S],
    the last tokens [S], which the next call feeds without a trip through the host). A slot goes idle (position 0,
    writing to scratch) after its last wanted token (`left`: tokens still wanted), so it never reaches past its
    pages (the paged kernel would read its page table out of bounds); one that stops at a stop id inside the call
    writes on into its own pages, and the host reads its tokens up to the stop."""
    (positions, active, steps, indices, left), pages = (inputs[:, i] for i in range(5)), inputs[:, 5:]

    def one(carry, _):
        pools, tokens, positions, active, steps, left = carry
        with matmul_precision(dtype):
            x, pools = _hidden(w, pools, tokens[:, None], positions[:, None], active[:, None], pages, m, dtype,
                               page, kernel)
            logits = _logits(w, x, m, dtype)
        token, logp = sample(logits[:, 0], _keys(seed, steps, indices), *settings)
        active = jnp.where(left <= 1, 0, active)  # idle from here on, at position 0 as an idle slot is
        return (pools, token, jnp.where(active > 0, positions + 1, 0), active, steps + 1, left - 1), (token, logp)

    carry = (pools, tokens, positions, active, steps, left)
    if steps_per_call == 1:  # one step as it is, not a loop of one
        carry, out = one(carry, None)
        return carry[0], _whole(out[0][None]), _whole(out[1][None]), constrain(carry[1], ("batch",))
    carry, (token, logp) = jax.lax.scan(one, carry, length=steps_per_call)
    return carry[0], _whole(token), _whole(logp), constrain(carry[1], ("batch",))


def _copy_page(pools, src, dst):
    """In every block's pool of each shard s, page `src`[s] copied to page `dst`[s] (a shared prompt's partial page,
    for one of its requests; scratch onto itself in a shard with none to copy), each shard in its own pool: the
    shards are the second dimension of a pool of keys or values (after the heads), the first of a latent pool."""
    def copy(pool, src, dst):  # one shard's pool: [(kv_heads,) repeats, n_pages, ...]
        return pool.at[:, :, dst].set(pool[:, :, src]) if pool.ndim == 5 else pool.at[:, dst].set(pool[:, src])

    def per_shard(a):
        shards = 1 if a.ndim == 6 else 0
        return jax.vmap(copy, (shards, 0, 0), shards)(a, src, dst)
    return [{k: per_shard(a) for k, a in block.items()} for block in pools]


def _pools(*, m, dtype, pages: int, page: int, layout):
    """Empty pools of `pages` pages for every block kind, one per data-parallel shard, laid out by `layout`."""
    return init_cache(m, pages, page, dtype, layout, paged=True)


class _Programs(NamedTuple):
    reshard: object
    pools: object
    prefill: object
    first: object
    decoder: object  # k -> the decode program of k steps a call
    copy_page: object


_compiled: dict = {}  # (model, dtype, page, stored layout, paged kernel) -> its programs; the newest few


def _under(layout, f):
    """`f` traced with `layout`'s constraints in force (none without one)."""
    @functools.wraps(f)
    def traced(*args, **kwargs):
        with use_layout(layout):
            return f(*args, **kwargs)
    return traced


def _programs(m, dtype, page: int, stored, kernel: tuple) -> _Programs:
    """The engine's programs for parameters `stored` as that layout says (None: one device), in the rollout layout,
    decoding with `kernel` (the paged kernel or None, interpreted or not); `decoder(k)` the decode program of k
    steps a call."""
    key, layout = (repr(m), str(dtype), page, stored, kernel), layout_for(stored)
    if key not in _compiled:
        if len(_compiled) >= 8:
            _compiled.pop(next(iter(_compiled)))
        kw = {"m": m, "dtype": dtype, "page": page}
        jit = lambda f, **options: jax.jit(_under(layout, f), **options)
        _compiled[key] = _Programs(
            jit(lambda params: transformer.per_repeat(_gathered_weights(params, m, dtype, layout, stored))),
            jit(functools.partial(_pools, m=m, dtype=dtype, page=page, layout=layout), static_argnames="pages"),
            jit(functools.partial(_prefill, **kw), donate_argnums=1), jit(_first, donate_argnums=5),
            functools.cache(lambda k: jit(functools.partial(_decode, **kw, kernel=kernel, steps_per_call=k),
                                          donate_argnums=1)),
            jit(_copy_page, donate_argnums=0))
    return _compiled[key]


# ---------------------------------------------------------------- the host side: pages, prompts, slots


PAGE = 16  # tokens a page, by default (GRPO's rollouts, `jaxllm generate --prompts`)


def pool_pages(slots: int, row_pages: int) -> int:
    """The pages a shard's pool needs for `slots` slots whose requests hold at most `row_pages` pages each: every
    slot's request at once, and the partial last page each prompt keeps beside its requests' copies (a prompt's
    full pages are held once, by all its requests: inside their own counts), and the scratch page."""
    return 1 + slots * (row_pages + 1)


class PagePool:
    """Which pages are free and how many requests (or prefilled prompts) hold each; page 0, scratch, is never
    given out."""

    def __init__(self, n: int):
        self.free, self.holders = list(range(n - 1, 0, -1)), [0] * n

    def take(self, k: int) -> list[int]:
        if k > len(self.free):  # the pool is sized for every slot's longest request: a bug, not a user's error
            raise RuntimeError(f"the page pool has {len(self.free)} free pages, {k} asked")
        taken = [self.free.pop() for _ in range(k)]
        self.hold(taken)
        return taken

    def hold(self, pages) -> None:
        for i in pages:
            self.holders[i] += 1

    def release(self, pages) -> None:
        for i in pages:
            self.holders[i] -= 1
            if self.holders[i] == 0:
                self.free.append(i)


@dataclasses.dataclass
class _Prompt:
    """A prompt's pages in a shard: its full pages (shared), its partial last page (None where the prompt fills
    its pages) and the copies of it its live requests write into, its last logits once prefilled (its prefill
    call's logits, a row per shard: the prompt's is its shard's), and how many live requests hold it."""
    full: list
    partial: int | None
    logits: jax.Array | None = None
    copies: dict = dataclasses.field(default_factory=dict)  # request index -> its copy of the partial page
    requests: int = 0

    @property
    def pages(self) -> list:
        """The pages holding the prompt's tokens, in order."""
        return self.full + ([self.partial] if self.partial is not None else [])


def _one_a_shard(items: list, key=lambda item: None) -> list[list]:
    """`items` (shard, ...) grouped into calls of at most one item a shard, all of one `key` (a prompt bucket),
    in order: each item joins the first call with its key and no item of its shard."""
    calls: list[list] = []
    for item in items:
        call = next((c for c in calls if key(c[0]) == key(item) and all(x[0] != item[0] for x in c)), None)
        if call is None:
            calls.append([item])
        else:
            call.append(item)
    return calls


@dataclasses.dataclass
class _Live:
    """A request in a slot: its index, prompt, pages, its first new token's position (the prompt's length), the tokens
    it holds once every call sent has run (`sent`, stop ids aside), its first token and log-probability on the
    device until read (`first`), the tokens read so far, and whether its pages were given back (`retired`: no call
    will be sent for it again)."""
    index: int
    prompt: tuple
    pages: list
    position: int
    slot: int
    first: tuple | None = None
    sent: int = 1
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    retired: bool = False


class _Call(NamedTuple):
    """A decode call sent and not yet read: its tokens and log-probabilities [steps_per_call, S] on the device, and
    the request each slot held when it was sent."""
    tokens: jax.Array
    logprobs: jax.Array
    owners: list


PAGED_KERNELS = ("auto", "xla") + paged_attention.KERNELS  # the engine's `paged_kernel`


def _choose_paged_kernel(choice: str, m, page: int, layout) -> tuple[str | None, bool]:
    """(the paged kernel a decode step calls, None for XLA's gather; whether interpreted): `auto` the GPU kernel on
    a GPU where it fits the model (`paged_attention.fits`, and no attention sinks), else the gather; a kernel named
    runs interpreted off its platform (tests) and is refused where it does not fit."""
    if choice not in PAGED_KERNELS:
        raise ConfigError(f"paged_kernel: '{choice}' is not one of {', '.join(PAGED_KERNELS)}")
    platform = (layout.mesh.devices.flat[0] if layout is not None else jax.devices()[0]).platform
    fits = (paged_attention.fits(m.attention == "mla", m.sliding_window, head_dim(m), page, m.attention_chunk)
            and not m.attn_sinks)
    if choice in ("auto", "xla"):
        return ("pallas_gpu", False) if choice == "auto" and platform == "gpu" and fits else (None, False)
    if m.attn_sinks:
        raise ConfigError(f"model.attn_sinks: the {choice} paged kernel cannot add a sink to the softmax; use "
                          "paged_kernel=auto or xla")
    if m.attention_chunk:
        raise ConfigError(f"model.attention_chunk: the {choice} paged kernel cannot mask by attention chunks; use "
                          "paged_kernel=auto or xla")
    if not fits:
        raise ConfigError(f"paged_kernel={choice}: the kernel does not compute this model's decode exactly (it "
                          "takes no window and no latent cache, and needs head_dim and the page a multiple of "
                          "16); use auto or xla")
    return choice, platform != "gpu"


class Engine:
    """Continuous batching over a paged cache (module docstring) for `params` of `cfg`'s model: up to `slots`
    requests decoded at once (`max_slots`: rounded up to a multiple of the data-parallel shards; a call of fewer
    requests runs that many slots, rounded up alike, since an idle slot's step costs a busy one's), `page` tokens a
    page. On one device, or with `on` (a StepFns, Layout or Mesh: where `params` live) on that mesh in the rollout
    layout; the weights are resharded into it once, here (`reshard_s` the seconds that took), for every `generate`
    call.
    `paged_kernel`: what a decode step attends over the pages with (`PAGED_KERNELS`; `kernel` the choice).
    `steps_per_call`: decode steps a program call runs before the host reads their tokens and admits requests (the
    same tokens; a slot freed inside a call waits for its end). `overlap`: each call is sent before the previous
    one's tokens are read, so the host's scheduling runs while the device decodes (the same tokens; False: the host
    waits for each call's tokens before it sends the next). `pages`: the pages of each shard's pool, scratch
    included (`pool_pages`; 0: what every slot's longest request needs at once); a request waits for its pages
    (the same tokens)."""

    def __init__(self, params, cfg, slots: int = 32, page: int = PAGE, on=None, paged_kernel: str = "auto",
                 steps_per_call: int = 1, overlap: bool = True, pages: int = 0):
        if has_linear(cfg.model):  # a slot's state would have to be kept and reset per request, not paged
            raise ConfigError(f"the paged engine (rl.sampler=engine) has no state for linear attention layers (model."
                              f"pattern {cfg.model.pattern}); use rl.sampler=static, whose generation carries it")
        for name, value in (("slots", slots), ("page", page), ("steps_per_call", steps_per_call)):
            if value < 1:  # with no slot no request is ever admitted, and generate would never return
                raise ConfigError(f"the engine's {name} must be 1 or more, got {value}")
        if pages < 0:
            raise ConfigError(f"the engine's pages must be 0 (as many as its slots need) or more, got {pages}")
        self.pages = pages
        self.m, self.dtype = _dropless(cfg.model), jnp.dtype(cfg.precision.compute)
        self.layout = layout_for(on)
        self.max_slots, self.page, self.overlap = padded_rows(slots, self.layout), page, overlap
        self.shards = padded_rows(1, self.layout)  # the data-parallel shards: of the slots, each with its pool
        self.kernel = _choose_paged_kernel(paged_kernel, self.m, page, self.layout)
        self.programs = _programs(self.m, self.dtype, page, layout_for(on, as_stored=True), self.kernel)
        self.decode = self.programs.decoder(steps_per_call)
        start = time.perf_counter()
        self.weights = jax.block_until_ready(self.programs.reshard(params))
        self.reshard_s = time.perf_counter() - start
        self.stats: dict = {}

    def generate(self, prompts: list, max_new_tokens, *, temperature: float = 1.0, top_k: int = 0,
                 top_p: float = 1.0, stop_ids=(), seed: int = 0, order=None) -> list[Completion]:
        """Each prompt's completion, as `decode.generate` gives it (the same tokens where the logits agree);
        `max_new_tokens` one for all or one per prompt; `order`: the requests' arrival order (default: as
        given). `stats` then holds the decode steps run, the most pages that held prompt tokens at once and that
        were held at once, the calls sent before the previous call's tokens were read, the times the next
        request waited for pages, and the prompts prefilled (one per shard that ran one of its requests) and the
        calls that prefilled them."""
        new = limits_checked(self.m, prompts, max_new_tokens, temperature, top_k, top_p, stop_ids)
        self._start(prompts, new)
        self.settings = self._put(np.float32(temperature), np.int32(top_k), np.float32(top_p))
        (self.seed,), self.stop_ids = self._put(np.uint32(seed)), set(stop_ids)
        self.prefilled, self.unprefilled = {}, []  # (shard, prompt) -> its pages; those not prefilled yet
        self.next_tokens = self._put(np.zeros(self.slots, np.int32), names=("batch",))[0]  # what the next call feeds
        self.stats = {"decode_steps": 0, "prompt_pages": 0, "pages_held": 0, "overlapped_calls": 0,
                      "waits_for_pages": 0, "prefills": 0, "prefill_calls": 0}
        waiting = collections.deque(range(len(prompts)) if order is None else order)
        self.live, self.unread_firsts, self.done, unread = [None] * self.slots, [], {}, None
        while waiting or any(self.live) or unread is not None or self.unread_firsts:
            self._admit_waiting(waiting)
            sent = self._send() if any(self.live) else None
            if unread is not None and sent is not None:
                self.stats["overlapped_calls"] += 1
            if not self.overlap and sent is not None:
                unread, sent = sent, None  # read at once
            self._read(unread)
            unread = sent
        return [self.done[i] for i in range(len(prompts))]

    def _put(self, *arrays, names=()) -> tuple:
        """Host arrays every process holds alike, as the programs take them: on a mesh global arrays, whole on
        every device (`names` ("batch",): a vector over the slots split over the data axes, as the programs leave
        it, so each program compiles once); on one device placed there (each program then takes device arrays
        at every call, as the ones it feeds itself, and compiles once)."""
        spec = P() if self.layout is None else logical_spec(names, self.layout.activations, self.layout.mesh)
        return tuple(put_host_arrays({i: np.asarray(a) for i, a in enumerate(arrays)}, self.layout, spec).values())

    def _start(self, prompts: list, new: list) -> None:
        """The slots for these requests (`max_slots`, or fewer for fewer requests) and each shard's pool of pages:
        `pages`, or what every slot's longest request needs at once; refused where one request's pages would not
        fit."""
        self.slots = min(self.max_slots, padded_rows(len(prompts), self.layout))
        self.new, self.prompts_in = new, prompts
        self.row_pages = -(-(max(map(len, prompts)) + max(new)) // self.page)  # the widest page table
        needs = [self._pages_needed(i) for i in range(len(prompts))]
        per_shard = self.pages or pool_pages(self.slots // self.shards, self.row_pages)
        if max(needs) + 1 > per_shard:  # with every other page free, the request still would not fit
            i = needs.index(max(needs))
            raise ConfigError(f"the engine's pages ({per_shard} a shard) cannot hold request {i} ({len(prompts[i])} "
                              f"prompt + {new[i]} new tokens: {needs[i]} pages of {self.page} and the scratch "
                              f"page); give pages >= {needs[i] + 1}, or 0 for what the slots need")
        self.page_pools = [PagePool(per_shard) for _ in range(self.shards)]
        self.pools = self.programs.pools(pages=per_shard)

    def _pages_needed(self, index: int, shard: int | None = None) -> int:
        """The free pages request `index` takes when admitted in `shard` (None: where its prompt is not prefilled):
        its own pages, and its prompt's where they are not written yet (with the partial last page the prompt
        keeps beside each request's copy)."""
        prompt, total = tuple(self.prompts_in[index]), self._request_pages(index)
        entry = self.prefilled.get((shard, prompt)) if shard is not None else None
        return total - len(entry.full) if entry is not None else total + (len(prompt) % self.page != 0)

    def _request_pages(self, index: int) -> int:
        """The pages request `index` holds while it runs: its prompt's and its new tokens' positions."""
        return -(-(len(self.prompts_in[index]) + self.new[index]) // self.page)

    def _admit_waiting(self, waiting: collections.deque) -> None:
        """The waiting requests admitted in order while a slot is free and its shard has the next one's pages (the
        next one waits otherwise, for a request to end and give its pages back): their slots and pages taken, then
        the new prompts prefilled and the partial pages copied (a prompt, or a copy, a shard in each call), then
        each one's first token drawn; again while a request that wanted one token gave its slot back."""
        while admitted := self._reserve_waiting(waiting):
            self._prefill_new()
            self._copy_partials(admitted)
            if not any([self._draw_first(live) for live in admitted]):
                return

    def _reserve_waiting(self, waiting: collections.deque) -> list[_Live]:
        """The waiting requests given a slot and pages, in order, while one is free for the next (host only)."""
        admitted = []
        while waiting and None in self.live:
            slot = self._free_slot(waiting[0])
            if slot is None:
                self.stats["waits_for_pages"] += 1
                if not any(self.live):  # every page free and still short: `_start` refuses this
                    raise RuntimeError(f"request {waiting[0]} waits for pages that no request holds")
                break
            self.live[slot] = self._reserve(waiting.popleft(), slot)
            admitted.append(self.live[slot])
        return admitted

    def _shard(self, slot: int) -> int:
        """The data-parallel shard a slot is in: the shard whose pool holds its pages."""
        return slot // (self.slots // self.shards)

    def _free_slot(self, index: int) -> int | None:
        """A shard's first free slot for request `index` where the shard has the pages it needs: a shard where its
        prompt is prefilled first (its pages shared, not prefilled again), then the one with the most free slots
        (new prompts spread over the shards, whose prefills share a call); None where no shard with a free slot
        has them."""
        prompt, free = tuple(self.prompts_in[index]), collections.defaultdict(list)  # shard -> its free slots
        for s, x in enumerate(self.live):
            if x is None:
                free[self._shard(s)].append(s)
        shards = sorted(free, key=lambda b: ((b, prompt) not in self.prefilled, -len(free[b]), b))
        return next((free[b][0] for b in shards if self._pages_needed(index, b) <= len(self.page_pools[b].free)),
                    None)

    def _prompt_in(self, prompt: tuple, shard: int) -> _Prompt:
        """The prompt's pages in `shard`'s pool: the ones a live request there shares, or new ones, to be prefilled
        (`_prefill_new`)."""
        if (shard, prompt) not in self.prefilled:
            pages = self.page_pools[shard].take(-(-len(prompt) // self.page))
            partial = pages.pop() if len(prompt) % self.page else None
            self.prefilled[shard, prompt] = _Prompt(pages, partial)
            self.unprefilled.append((shard, prompt))
        return self.prefilled[shard, prompt]

    def _reserve(self, index: int, slot: int) -> _Live:
        """Request `index` in `slot`: its prompt's pages (shared), fresh pages for the rest (the first of them its
        copy of the prompt's partial page, if any)."""
        prompt, shard = tuple(self.prompts_in[index]), self._shard(slot)
        entry, pool = self._prompt_in(prompt, shard), self.page_pools[shard]
        entry.requests += 1
        pool.hold(entry.full)
        own = pool.take(self._request_pages(index) - len(entry.full))
        if entry.partial is not None:
            entry.copies[index] = own[0]
        self.stats["prompt_pages"] = max(self.stats["prompt_pages"], len(self._prompt_pages()))
        held = sum(len(p.holders) - 1 - len(p.free) for p in self.page_pools)
        self.stats["pages_held"] = max(self.stats["pages_held"], held)
        return _Live(index, prompt, entry.full + own, len(prompt), slot)

    def _prefill_new(self) -> None:
        """The prompts given pages since the last call, prefilled: in calls of one prompt bucket, a prompt a shard
        in each (the call's other shards idle)."""
        for call in _one_a_shard(self.unprefilled, key=lambda item: bucket(len(item[1]))):
            tokens = np.zeros((self.shards, bucket(len(call[0][1]))), np.int32)
            lengths, pages = np.zeros(self.shards, np.int32), [[] for _ in range(self.shards)]
            for shard, prompt in call:
                tokens[shard, :len(prompt)], lengths[shard] = prompt, len(prompt)
                pages[shard] = self.prefilled[shard, prompt].pages
            self.pools, logits = self.programs.prefill(self.weights, self.pools,
                                                       *self._put(tokens, lengths, self._table(pages)))
            for shard, prompt in call:
                self.prefilled[shard, prompt].logits = logits
            self.stats["prefill_calls"] += 1
            self.stats["prefills"] += len(call)
        self.unprefilled = []

    def _copy_partials(self, admitted: list[_Live]) -> None:
        """Each request's copy of its prompt's partial page written (the completions write their first tokens
        there): a copy a shard in each call (the others copy their scratch page onto itself)."""
        copies = []
        for live in admitted:
            shard = self._shard(live.slot)
            entry = self.prefilled[shard, live.prompt]
            if entry.partial is not None:
                copies.append((shard, entry.partial, entry.copies[live.index]))
        for call in _one_a_shard(copies):
            src, dst = np.zeros(self.shards, np.int32), np.zeros(self.shards, np.int32)
            for shard, page, copy in call:
                src[shard], dst[shard] = page, copy
            self.pools = self.programs.copy_page(self.pools, *self._put(src, dst))

    def _draw_first(self, live: _Live) -> bool:
        """The request's first token drawn into its slot's next token on the device (read with the next call's
        tokens); True where it wants no more (its slot and pages given back at once)."""
        shard = self._shard(live.slot)
        index, slot, row = self._put(np.int32(live.index), np.int32(live.slot), np.int32(shard))
        self.next_tokens, token, logp = self.programs.first(self.prefilled[shard, live.prompt].logits, row,
                                                            self.seed, index, self.settings, self.next_tokens, slot)
        live.first = (token, logp)
        self.unread_firsts.append(live)
        if self.new[live.index] > 1:
            return False
        self._retire(live)
        return True

    def _prompt_pages(self) -> set[tuple[int, int]]:
        """The pages that hold prompt tokens now, (shard, page): the prefilled prompts' and the requests' copies of
        their partial pages."""
        return {(shard, p) for (shard, _), e in self.prefilled.items() for p in e.pages + list(e.copies.values())}

    def _retire(self, live: _Live) -> None:
        """No call will be sent for the request again: its slot and pages given back. A call sent before may still
        write into them; the device runs calls in the order sent, so that write lands before any later request's."""
        live.retired = True
        if self.live[live.slot] is live:
            self.live[live.slot] = None
        key = (self._shard(live.slot), live.prompt)
        pool, entry = self.page_pools[key[0]], self.prefilled[key]
        pool.release(live.pages)
        entry.requests -= 1
        entry.copies.pop(live.index, None)
        if entry.requests == 0:
            pool.release(entry.pages)
            del self.prefilled[key]

    def _take(self, live: _Live, token: int, logp: float) -> bool:
        """The drawn token kept; True where the request ends with it (its completion done, its pages given back)."""
        live.tokens.append(token)
        live.logprobs.append(logp)
        stopped = token in self.stop_ids
        if not stopped and len(live.tokens) < self.new[live.index]:
            return False
        self.done[live.index] = Completion(np.asarray(live.tokens, np.int32), np.asarray(live.logprobs, np.float32),
                                           stopped)
        if not live.retired:
            self._retire(live)
        return True

    def _table(self, pages: list) -> np.ndarray:
        table = np.zeros((len(pages), self.row_pages), np.int32)
        for r, row in enumerate(pages):
            table[r, :len(row)] = row
        return table

    def _send(self) -> _Call:
        """One call of decode steps over every slot, sent: each busy slot continues from what the calls sent before
        leave it (its next token already on the device); a request whose last wanted token this call draws is
        retired at once, so its slot takes the next request for the next call."""
        busy = [x for x in self.live if x is not None]
        positions, active, steps, indices, left = (np.zeros(self.slots, np.int32) for _ in range(5))
        for x in busy:
            s = x.slot
            positions[s], active[s], steps[s] = x.position + x.sent - 1, 1, x.sent
            indices[s], left[s] = x.index, self.new[x.index] - x.sent
        table = self._table([x.pages if x is not None else [] for x in self.live])
        (inputs,) = self._put(slot_inputs(positions, active, steps, indices, left, table))
        self.pools, tokens, logprobs, self.next_tokens = self.decode(self.weights, self.pools, self.next_tokens, inputs,
                                                                     self.seed, self.settings)
        call = _Call(tokens, logprobs, list(self.live))
        self.stats["decode_steps"] += tokens.shape[0]
        for x in busy:
            x.sent += tokens.shape[0]
            if x.sent >= self.new[x.index]:
                self._retire(x)
        return call

    def _read(self, call: _Call | None) -> None:
        """The first tokens drawn since the last read, then `call`'s tokens (if any), recorded: each request's up to
        where it ends; what a call drew for a request that had already ended is dropped."""
        for x in self.unread_firsts:
            self._take(x, int(x.first[0]), float(x.first[1]))
        self.unread_firsts = []
        if call is None:
            return
        tokens, logprobs = np.asarray(call.tokens), np.asarray(call.logprobs)
        for s, x in enumerate(call.owners):
            if x is None or x.index in self.done:
                continue
            for t in range(tokens.shape[0]):
                if self._take(x, int(tokens[t, s]), float(logprobs[t, s])):
                    break
