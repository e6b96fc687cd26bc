"""Call preparation: every public call's arrays and options checked once,
normalised and turned into a prepared call that the driver runs as it is.

    arrays.py    operands: dtypes, byte order, shapes, outputs, shared memory
    options.py   RowOptions (scale, window, softcap, ALiBi, sinks, threads)
    int8.py      int8 K/V: quantization and row scales
    dense.py     dense calls (attention, attention_scores), grouped heads
    caches.py    KV caches, contiguous and paged: storage, lengths, appends
    rotary.py    rotary embeddings of the cache calls: tables, positions
    entries.py   sequences of their own lengths: packed batches, paged caches
    kvcache.py   a step against a contiguous KV cache
    paged.py     a step against a paged KV cache
"""
