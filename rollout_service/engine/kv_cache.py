"""Paged KV cache: the block manager (ref-counted pages, the prefix cache) and the per-layer tensors.

Layout per layer: [num_pages, 2, num_kv_heads, page_size, head_dim] (0 = K, 1 = V), so one head of one
page is a contiguous page_size x head_dim tile for the kernels. Page 0 is a scratch page that is never
handed out: padded rows of a CUDA-graph batch write their K/V there.
"""
from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from rollout_service.engine.routed_experts import RoutingStore

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from rollout_service.engine.sequence import Sequence


class BlockManager:
    """The one owner of KV pages: which pages each sequence holds, their reference counts, the free list and
    the prefix cache. The scheduler decides what runs; every page a sequence gains or loses goes through here.

    A page shared by k sequences (the prompt of n samples, or a cached prefix) has count k. A full page whose
    tokens all have KV can be cached: keyed by (the key of the page before it, its token ids, the policy
    version its KV was computed under), so a key names the whole prefix up to the page's end. When its last
    sequence lets go, a cached page is not freed but kept, unreferenced, in LRU order; a later sequence
    whose tokens match takes it instead of prefilling them. Unreferenced cached pages are evicted (oldest
    first) whenever free pages run out, so they never cost a running sequence its pages: allocation only
    fails, and the scheduler only preempts, once no cached page is left to evict.

    KV computed under old weights must not be reused silently: keys carry the policy version (unless
    `across_versions`), and a sequence whose KV spans a refresh caches nothing more. Every page remembers the
    version it was first written under, so a sequence's `kv_version` is the oldest KV it holds (its tokens'
    RolloutResult.kv_versions), prefix-cache hits and forks included.
    """

    def __init__(self, num_pages: int, page_size: int, copy_page: Callable[[int, int], None],
                 enable_cache: bool = True, across_versions: bool = False):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages}: need at least 2 (page 0 is reserved)")
        self.num_pages, self.page_size = num_pages, page_size
        self._copy_page = copy_page
        self.enable_cache, self.across_versions = enable_cache, across_versions
        self.version = 0
        self.refcount = [0] * num_pages
        self.refcount[0] = 1  # scratch page, never freed
        self.page_version = [0] * num_pages  # the policy version each page's KV was first written under
        # A stack, lowest page on top: the most recently freed page is reused first, so a CPU engine's resident
        # memory is the KV it has needed at once, not its whole pool: taken from the front, freed pages went to
        # the back and every page of the pool got touched in turn (RSS +1.3 MiB per refresh with generation
        # in flight, the pool's gigabyte over time: issue 45, item 5).
        self._free = deque(range(num_pages - 1, 0, -1))
        self._key_of: dict[int, int] = {}                    # cached page -> its key
        self._entry: dict[int, tuple[int, tuple, int]] = {}  # key -> (previous key, tokens, version): checked
        self._page_of: dict[int, int] = {}                   # key -> cached page
        self._idle: OrderedDict[int, None] = OrderedDict()   # unreferenced cached pages, least recent first
        self.stats = CacheStats()

    # ---- counts ------------------------------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        """Pages a sequence can get now: free ones plus unreferenced cached ones (evicted on demand)."""
        return len(self._free) + len(self._idle)

    @property
    def num_used(self) -> int:
        """Pages some sequence holds."""
        return self.num_usable - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._key_of)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    # ---- a sequence's pages --------------------------------------------------------------------------
    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give `seq` pages for its first `num_tokens` tokens (the caller checked can_allocate)."""
        need = pages_for(num_tokens, self.page_size) - len(seq.pages)
        if need > self.num_free:
            raise RuntimeError(f"BlockManager: asked for {need} pages, {self.num_free} free")
        if need > 0 and not seq.pages:
            seq.kv_version = self.version
        seq.pages += [self._take_free() for _ in range(need)]

    def match_prefix(self, seq: Sequence) -> list[int]:
        """The cached pages holding a prefix of `seq`'s tokens, up to its `num_reusable` (at least one token is
        left to compute, so that the prefill yields the logits it needs). Looks only; `take_prefix` claims them."""
        if not self.enable_cache or seq.pages or seq.num_computed:
            return []
        ps, hits, key = self.page_size, [], 0
        for i in range(seq.num_reusable // ps):
            entry = (key, tuple(seq.token_slice(i * ps, (i + 1) * ps)), self._salt(self.version))
            key = hash(entry)
            page = self._page_of.get(key)
            if page is None or self._entry[key] != entry:
                break
            hits.append(page)
        return hits

    def num_idle(self, pages: list[int]) -> int:
        """How many of these cached pages nobody holds (claiming them takes them off the evictable list)."""
        return sum(1 for p in pages if self.refcount[p] == 0)

    def take_prefix(self, seq: Sequence, pages: list[int]) -> None:
        """Claim `match_prefix`'s pages for `seq`: their tokens count as computed."""
        self.stats.queried_tokens += seq.num_tokens
        self.stats.hit_tokens += len(pages) * self.page_size
        if not pages:
            return
        for p in pages:
            self._ref(p)
        seq.pages, seq.kv_version = list(pages), min(self.page_version[p] for p in pages)
        seq.page_keys = [self._key_of[p] for p in pages]
        seq.num_computed = len(pages) * self.page_size

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares `parent`'s full pages; the partial last page is copied (copy-on-write)."""
        partial = parent.num_tokens % self.page_size != 0
        shared = parent.pages[:-1] if partial else parent.pages
        for p in shared:
            self._ref(p)
        child.pages = list(shared)
        child.page_keys = list(parent.page_keys)
        child.kv_version = parent.kv_version
        if partial:
            child.pages.append(self._take_free())
            self._copy_page(parent.pages[-1], child.pages[-1])
            self.page_version[child.pages[-1]] = self.page_version[parent.pages[-1]]

    def cache_full_pages(self, seq: Sequence) -> None:
        """Make `seq`'s full, computed pages findable by later sequences (after a prefill, before a free)."""
        if not self.enable_cache or (seq.kv_version != self.version and not self.across_versions):
            return
        ps, keys = self.page_size, seq.page_keys
        for i in range(len(keys), min(seq.num_computed // ps, len(seq.pages))):
            entry = (keys[-1] if keys else 0, tuple(seq.token_slice(i * ps, (i + 1) * ps)), self._salt(seq.kv_version))
            key = hash(entry)
            page = seq.pages[i]
            if key not in self._page_of and page not in self._key_of:
                self._page_of[key], self._entry[key], self._key_of[page] = page, entry, key
            keys.append(key)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Let go of `seq`'s pages past its first `num_tokens` tokens (a draft's rejected positions: never
        computed, so never cached or shared)."""
        keep = pages_for(num_tokens, self.page_size)
        for p in seq.pages[keep:]:
            self._unref(p)
        del seq.pages[keep:]

    def free(self, seq: Sequence) -> None:
        """Let go of every page of `seq` (finished, aborted or preempted); it holds none after."""
        self.cache_full_pages(seq)
        for p in seq.pages:
            self._unref(p)
        seq.pages, seq.page_keys, seq.num_computed = [], [], 0

    # ---- versions and sleep --------------------------------------------------------------------------
    def set_version(self, version: int) -> None:
        """A weight refresh: cached KV of older versions will never match again, so it is freed now."""
        self.version = version
        if not self.across_versions:
            for p in list(self._idle):
                self._uncache(p)
                self._free.append(p)
            self._idle.clear()

    def drop_cache(self) -> None:
        """Forget every cached page (their KV is about to be freed: sleep); sequences must hold none."""
        assert self.num_used == 0, "dropping the prefix cache while sequences hold pages"
        for p in list(self._key_of):
            self._uncache(p)
        self._free.extend(self._idle)
        self._idle.clear()

    # ---- internals ---------------------------------------------------------------------------------------
    def _salt(self, version: int) -> int:
        return 0 if self.across_versions else version

    def _take_free(self) -> int:
        if self._free:
            page = self._free.pop()
        else:  # evict the least recently used unreferenced cached page
            page, _ = self._idle.popitem(last=False)
            self._uncache(page)
            self.stats.evictions += 1
        self.refcount[page] = 1
        self.page_version[page] = self.version
        return page

    def _ref(self, page: int) -> None:
        assert self.refcount[page] > 0 or page in self._idle, f"sharing free page {page}"
        if self.refcount[page] == 0:
            del self._idle[page]
        self.refcount[page] += 1

    def _unref(self, page: int) -> None:
        assert page != 0 and self.refcount[page] > 0, f"releasing free or scratch page {page}"
        self.refcount[page] -= 1
        if self.refcount[page]:
            return
        key = self._key_of.get(page)
        if key is not None and self._entry[key][2] == self._salt(self.version):
            self._idle[page] = None  # most recently used last
        else:
            if key is not None:
                self._uncache(page)
            self._free.append(page)

    def _uncache(self, page: int) -> None:
        key = self._key_of.pop(page)
        del self._page_of[key], self._entry[key]


@dataclass
class CacheStats:
    queried_tokens: int = 0  # tokens of the sequences looked up when they were first admitted
    hit_tokens: int = 0      # of those, tokens whose KV came from the cache
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class KVCache:
    """The block manager plus one K/V tensor per layer, and for a mixture-of-experts model the routing store
    (engine/routed_experts.py), whose slots follow the pages: copied, released and reallocated with them."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, page_size: int, num_pages: int,
                 dtype: torch.dtype, device: torch.device | str, enable_prefix_cache: bool = True,
                 prefix_cache_across_versions: bool = False, routing: RoutingStore | None = None):
        self.page_size = page_size
        self.routing = routing
        shape = (num_pages, 2, num_kv_heads, page_size, head_dim)
        self.layers = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.blocks = BlockManager(num_pages, page_size, self.copy_page, enable_prefix_cache,
                                   prefix_cache_across_versions)

    @staticmethod
    def bytes_per_page(num_layers: int, num_kv_heads: int, head_dim: int, page_size: int,
                       dtype: torch.dtype) -> int:
        return num_layers * 2 * num_kv_heads * page_size * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        """Bytes held now (0 while released)."""
        routing = self.routing.nbytes if self.routing else 0
        return sum(layer.untyped_storage().nbytes() for layer in self.layers) + routing

    def capacity_bytes(self) -> int:
        """Bytes of every page: what the cache holds when allocated."""
        routing = self.routing.capacity_bytes() if self.routing else 0
        return sum(layer.numel() * layer.element_size() for layer in self.layers) + routing

    def release(self) -> None:
        """Free the cache's memory (sleep); no sequence may hold pages. Cached prefixes are forgotten."""
        self.blocks.drop_cache()
        for layer in self.layers:
            layer.untyped_storage().resize_(0)
        if self.routing:
            self.routing.release()

    def reallocate(self) -> None:
        """Memory for every page again (wake); contents undefined, as at start-up."""
        for layer in self.layers:  # layer by layer: a wake that ran out of memory part-way is retried
            want = layer.numel() * layer.element_size()
            if layer.untyped_storage().nbytes() != want:
                layer.untyped_storage().resize_(want)
        if self.routing:
            self.routing.reallocate()

    def copy_page(self, src: int, dst: int) -> None:
        """Copy one page's K/V (the block manager's copy-on-write of a forked sample's partial page)."""
        for layer in self.layers:
            layer[dst].copy_(layer[src])
        if self.routing:
            self.routing.copy_page(src, dst)


def sized_kv_cache(model: Any, config: Any, device: torch.device, max_model_len: int) -> KVCache:
    """The engine's KV cache: `config.num_pages` pages, or as many as fit (the free GPU memory times
    gpu_memory_utilization less headroom for activations and graphs; on the CPU kv_cache_memory_gb), never
    more than max_num_seqs sequences of max_model_len tokens need. A mixture-of-experts model's blocks are given
    their views of the routing store."""
    num_layers, num_kv_heads, head_dim = model.kv_cache_spec()
    dtype = next(model.parameters()).dtype
    ps = config.page_size
    page_bytes = KVCache.bytes_per_page(num_layers, num_kv_heads, head_dim, ps, dtype)
    page_bytes += RoutingStore.bytes_per_page(model, ps)
    num_pages = config.num_pages
    if num_pages is None:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = free * config.gpu_memory_utilization - (2 << 30)  # headroom: activations, graphs
        else:
            budget = config.kv_cache_memory_gb * (1 << 30)
        wanted = config.max_num_seqs * pages_for(max_model_len, ps) + 1
        num_pages = max(2, min(int(budget // page_bytes), wanted))
    log.info("KV cache: %d pages of %d tokens (%.2f GiB)", num_pages, ps, num_pages * page_bytes / 2**30)
    return KVCache(num_layers, num_kv_heads, head_dim, ps, num_pages, dtype, device, config.enable_prefix_cache,
                   config.prefix_cache_across_versions, RoutingStore.for_model(model, num_pages, ps, device))
