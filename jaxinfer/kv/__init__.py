"""KV cache: paged MLA latent cache on device, reference-counted page allocator and prefix cache on the host.

One ``PageAllocator`` (and ``PrefixCache``) per DP rank; page ids are rank-local (see ``paged_cache``).
"""

from jaxinfer.kv.page_allocator import NULL_PAGE, PAGE_SIZE, OutOfPages, PageAllocator
from jaxinfer.kv.paged_cache import (
    PagedLatentCache,
    bits_dtype,
    bytes_per_page,
    cache_sharding,
    default_num_pages,
    holds_bits,
    init_paged_cache,
    latent_width,
    take_pages,
    value_dtype,
    write,
)
from jaxinfer.kv.prefix_cache import PrefixCache, PrefixCacheStats, page_hashes

__all__ = [
    "NULL_PAGE", "PAGE_SIZE", "OutOfPages", "PageAllocator", "PagedLatentCache", "PrefixCache", "PrefixCacheStats",
    "bits_dtype", "bytes_per_page", "cache_sharding", "default_num_pages", "holds_bits", "init_paged_cache",
    "latent_width", "page_hashes", "take_pages", "value_dtype", "write",
]
