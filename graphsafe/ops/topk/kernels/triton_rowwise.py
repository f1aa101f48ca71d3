"""Decode top-k in one launch, one program a row (`_rowwise_kernel`; chosen by
`plan.choose_top_k_per_row_decode`, bound by the Triton backend's `triton.bind_rowwise`).

The two-launch plan (triton_two_launch.py) splits a row over several programs, each finding its
own bound by a radix search over column maxima and placing its kept entries with
CTA-wide scans: chains of CTA-wide steps, not memory-bound (benchmarks/NOTES.md,
"Top-k"). With a row a program, the pass over the row needs no CTA-wide step at all:

A. Sample (`_sample_bound`). S single floats spread evenly over the row's valid range.
   With p = topk / n, about mu = p * S samples lie at or above the row's topk-th largest
   key, give or take sigma = sqrt(S p (1 - p)).
   The bound `vlo` is a sample key with about mu + Z sigma + 2 samples at or above it (a
   radix select over the samples: three rounds of `_ranked_bin`): at
   least topk entries of the row lie at or above it unless the sample is off by more
   than Z sigma. After the first round the pass's first tile is loaded, in flight while
   the sample is ranked.
B. Collect (`_collect`). The row in [E, 32 * warps] tiles (entry (e, t) in register e of
   thread t; 16-byte loads where the rows allow it); every entry >= vlo goes to its
   warp's region of the scratch (key << 32 | position). Each thread counts its own kept
   entries and takes its slots after the lanes below it (one warp scan of 5 shuffles a
   tile, `_place_at_least`): no shared memory, no CTA-wide step. When the sample saw
   ties at the bound, entries == vlo go to the top of the region instead (placed by
   ballots), so a run of equal scores cannot crowd out a larger one.
C. If fewer than topk entries were kept, or a region overflowed, the pass runs once
   more with the bound RETRY_Z sigma out (too few) or Z/2 in (overflow); if that fails
   too, the exact radix select over the row (`triton_common.select_row`).
D. Select (`_select_kept`), in the same program after a barrier: the regions come back
   from L2, a warp its own, and a search over 32-bin histograms (ballots again, each
   lane counting its own bin: `_ranked_bin`) finds the topk-th largest kept key; every
   key above it and enough of its ties are written, each entry's place from ballots and
   one scan over the warps. Usually three rounds; after the first, the few hundred keys
   left in the bin are moved to shared memory so that the later rounds run over a small
   tile.

Rows with at most topk valid entries are written without data. Nothing is zeroed, no
atomics; the regions' order is fixed (warp, then position), so results are
deterministic. On a GPU the loads, ballots, shuffles, histograms and stores of the hot
paths are inline PTX (`ASM`): an asm keeps its operands' one-entry-a-thread layout (a
`tl.load` gets a vector layout, and scattered stores after it shuffle through shared
memory), and compares inside the asm avoid i1 tensors between calls (Triton packs those
into bit fields). The CTA-wide steps (a search round's histogram, the scans over the
warps, the reductions of the sample and of the pass's counts) go through static shared
buffers that the asm declares: one barrier each, where Triton's cross-warp reduction
takes three. The sm_90 compile test checks the layouts the asm relies on.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphsafe.ops.topk.kernels.triton_common import row_bounds, select_row, write_positions
from graphsafe.ops.topk.plan import NMETA

_NMETA = tl.constexpr(NMETA)


@triton.jit
def _min_max_max(a0, a1, a2, b0, b1, b2):
    return tl.minimum(a0, b0), tl.maximum(a1, b1), tl.maximum(a2, b2)


@triton.jit
def _min_max_max_axis0(a, b, c, ASM: tl.constexpr):
    """(min a, max b, max c) along axis 0 of unsigned keys: one tuple reduction where the
    inline-asm path runs (sm_90), three native ones elsewhere (the same values: integers;
    Triton's interpreter runs a tuple reduction's combine function per element in Python,
    about 100x slower than its numpy reductions)."""
    if ASM:
        return tl.reduce((a, b, c), 0, _min_max_max)
    else:
        return tl.min(a, 0), tl.max(b, 0), tl.max(c, 0)


@triton.jit
def _sample_bound(row_ptr, lo, hi, topk, Z, SE: tl.constexpr, E: tl.constexpr, T: tl.constexpr, VEC: tl.constexpr,
                  ASM: tl.constexpr):
    """(vlo, ties, smax, first) from SE * T samples spread evenly over [lo, hi), an [SE, T]
    tile (module docstring, A).

    vlo: about the largest sample key with mu + Z sigma + 2 samples at or above it, from a
    radix select over the samples: three rounds of `_ranked_bin` over the next 5 key
    bits. A 15-bit prefix is enough: vlo is the smallest sample key that shares or
    exceeds it (a few more candidates, never fewer). ties: the prefix's range
    holds two or more samples, all one key (the row likely holds a run of them). smax:
    the largest sample key (sizes the selection's first bins). first: the collect pass's
    first tile, loaded after the first round: in flight while the sample is ranked, and
    not competing with the sample's own loads."""
    S: tl.constexpr = SE * T
    n = hi - lo
    # Single floats, one a sector: runs of consecutive floats would cost fewer sectors,
    # but they sample runs of equal or related scores as one (benchmarks/NOTES.md).
    j = tl.arange(0, SE)[:, None] * T + tl.arange(0, T)[None, :]
    q = n // S
    rem = n - q * S
    pos = lo + j * q + (j * rem) // S
    skey = _tile_keys(_load_tile(row_ptr, pos, hi, False, ASM, L1=True), pos, hi, False)
    p = topk.to(tl.float32) / n.to(tl.float32)
    mu = p * S
    need = tl.minimum((mu + Z * tl.sqrt(mu * (1.0 - p))).to(tl.int32) + 2, S)
    prefix = tl.full([], 0, tl.uint32)
    last = tl.full([], 0xFFFFFFFF, tl.uint32)
    c_above = need * 0
    n_bin = need * 0
    buf = _shared_buffer(2 * T, ASM)  # the rounds' exchanges, two halves (`_ranked_bin`)
    for d in tl.static_range(3):
        SHIFT = 27 - 5 * d
        # The digit: the largest bin where the count from the top reaches `need` (0 if none).
        digit, above, n_bin = _ranked_bin(skey, prefix, last, prefix * 0 + SHIFT, c_above, need, buf + (d % 2) * T * 4,
                                          SE, T, ASM)
        c_above += above
        prefix = prefix + (digit.to(tl.uint32) << SHIFT)
        last = prefix + ((1 << SHIFT) - 1)
        if d == 0:
            first = _load_tile(row_ptr, _tile_positions(E, T, VEC), hi, VEC, ASM, True)
    # The smallest sample key in the prefix's range or above it (the prefix's low edge
    # would split a run of equal keys into "above" and "tied"); at least 1, as key 0
    # means "no key" (masked entries). A thread's registers first, then across the
    # threads.
    vmin, bin_max, smax = _min_max_max_axis0(tl.where(skey >= prefix, skey, 0xFFFFFFFF), tl.where(skey <= last, skey, 0),
                                             skey, ASM)
    vmin, bin_max, smax = _cta_min_max_max(vmin, bin_max, smax, T, ASM)
    return tl.maximum(vmin, 1), (n_bin >= 2) & (vmin == bin_max), smax, first


# Ranks by one ballot of flag $2 != 0: $0 = # lanes below this one with the flag set,
# $1 = # lanes with it set.
_RANK_FLAG_ASM = tl.constexpr(
    "{ .reg .pred p; .reg .b32 b, m; setp.ne.b32 p, $2, 0; vote.sync.ballot.b32 b, p, 0xffffffff; "
    "mov.b32 m, %lanemask_lt; and.b32 m, m, b; popc.b32 $0, m; popc.b32 $1, b; }")


@triton.jit
def _warp_rank(flag, E: tl.constexpr, T: tl.constexpr, ASM: tl.constexpr):
    """For an [E, T] tile whose entry (e, t) thread t holds: (rank, total) with rank = #
    entries (e, t') of t's warp with t' < t and the flag set, total = # in the warp.

    On a GPU one ballot a register (`vote.ballot` + `popc`): no shuffles, no shared
    memory. The tile must then have the layout with entry (e, t) in register e of
    thread t (Triton's default for [E, 32 * warps]; checked by the sm_90 compile test)."""
    if ASM:
        rank, total = tl.inline_asm_elementwise(
            _RANK_FLAG_ASM, "=r,=r,r", [flag.to(tl.int32)], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        return rank, total
    else:
        f = tl.reshape(flag.to(tl.int32), [E, T // 32, 32])
        rank = tl.cumsum(f, 2) - f
        total = tl.broadcast_to(tl.sum(f, 2)[:, :, None], [E, T // 32, 32])
        return tl.reshape(rank, [E, T]), tl.reshape(total, [E, T])


# `_load_tile`'s 16-byte asm: $0..$3 the floats' bits; $4 the row (of 4 copies), $8 the
# first position (a multiple of 4; $9..$11 the next three), $12 hi (of 4 copies).
# Nothing is loaded from hi on: the caller masks those entries (`_tile_keys`).
_LOAD_BITS4_ASM = tl.constexpr(
    "{ .reg .pred p; .reg .b64 a; setp.lt.s32 p, $8, $12; mad.wide.s32 a, $8, 4, $4; "
    "@p ld.global.nc.L1::no_allocate.v4.b32 {$0, $1, $2, $3}, [a]; }"
)
# `_load_tile`'s 4-byte asm: $0 the bits (0xFFFFFFFF from hi on), $1 the row, $2 the
# position, $3 hi.
_LOAD_BITS = ("{{ .reg .pred p; .reg .b64 a; setp.lt.s32 p, $2, $3; mov.b32 $0, -1; mad.wide.s32 a, $2, 4, $1; "
              "@p ld.global.nc{}.b32 $0, [a]; }}")
_LOAD_BITS_ASM = tl.constexpr(_LOAD_BITS.format(".L1::no_allocate"))
_LOAD_BITS_L1_ASM = tl.constexpr(_LOAD_BITS.format(""))


@triton.jit
def _tile_positions(E: tl.constexpr, T: tl.constexpr, VEC: tl.constexpr):
    """[E, T] offsets of a collect step's entries, entry (e, t) in register e of thread t.
    VEC: registers 4j..4j+3 of thread t hold 4 consecutive floats (one 16-byte load),
    4j * T + 4t: a warp's load of a register group reads 512 contiguous bytes.
    Otherwise e * T + t (a warp's load of a register reads 128 contiguous bytes)."""
    e = tl.arange(0, E)[:, None]
    t = tl.arange(0, T)[None, :]
    if VEC:
        return (e // 4) * (4 * T) + t * 4 + e % 4
    else:
        return e * T + t


@triton.jit
def _load_tile(row_ptr, pos, hi, VEC: tl.constexpr, ASM: tl.constexpr, PINNED: tl.constexpr = False,
               L1: tl.constexpr = False):
    """The bits of a tile's floats (`_tile_positions`'s layout), turned into keys by
    `_tile_keys` (not here: the first instruction that reads a load's result waits for
    it, and the next tile's loads should stay in flight while the current one is sorted
    out). On a GPU with VEC, one 16-byte load a register group (the asm takes 4 registers
    at once, `pack=4`; registers 4j..4j+3 must hold consecutive positions, the first a
    multiple of 4); entries from hi on are undefined there. Otherwise entries from hi on
    read as 0xFFFFFFFF (key 0). PINNED: the load stays where it is in the program (a
    pure asm may be hoisted above barriers). L1 (4-byte loads): allocate the lines in L1
    (the sample's scattered loads: 37.8 against 41.1 us at 128 x 131072, H100); the
    pass streams past L1."""
    if VEC:
        if ASM:
            return tl.inline_asm_elementwise(
                _LOAD_BITS4_ASM, "=r,=r,=r,=r,l,l,l,l,r,r,r,r,r,r,r,r", [row_ptr, pos, hi], dtype=tl.uint32,
                is_pure=not PINNED, pack=4)
    if ASM:
        return tl.inline_asm_elementwise(
            _LOAD_BITS_L1_ASM if L1 else _LOAD_BITS_ASM, "=r,l,r,r", [row_ptr, pos, hi], dtype=tl.uint32,
            is_pure=not PINNED, pack=1)
    else:
        bits = tl.load(row_ptr + pos, mask=pos < hi, other=0.0).to(tl.uint32, bitcast=True)
        return tl.where(pos < hi, bits, 0xFFFFFFFF)


@triton.jit
def _tile_keys(bits, pos, hi, partial):
    """Keys of a loaded tile (triton_common's `sortable_key` of the bits), 0 from hi on:
    only a `partial` tile (the row's last) pays for the mask."""
    key = bits ^ ((bits.to(tl.int32, bitcast=True) >> 31).to(tl.uint32, bitcast=True) | 0x80000000)
    if partial:
        key = tl.where(pos < hi, key, 0)
    return key


_WARP_SCAN_STEP = "shfl.sync.up.b32 t|p, s, {}, 0, 0xffffffff; @p add.s32 s, s, t; "
_WARP_SCAN_ASM = tl.constexpr(
    "{ .reg .pred p; .reg .b32 s, t; mov.b32 s, $2; "
    + "".join(_WARP_SCAN_STEP.format(1 << j) for j in range(5))
    + "sub.s32 $0, s, $2; shfl.sync.idx.b32 $1, s, 31, 0x1f, 0xffffffff; }"
)


@triton.jit
def _warp_scan(count, T: tl.constexpr, ASM: tl.constexpr):
    """[T], one count a thread -> (sum over the lanes below in its warp, its warp's sum):
    five shuffles up on a GPU."""
    if ASM:
        before, total = tl.inline_asm_elementwise(
            _WARP_SCAN_ASM, "=r,=r,r", [count], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        return before, total
    else:
        c = tl.reshape(count, [T // 32, 32])
        before = tl.cumsum(c, 1) - c
        total = tl.broadcast_to(tl.sum(c, 1)[:, None], [T // 32, 32])
        return tl.reshape(before, [T]), tl.reshape(total, [T])


@triton.jit
def _store_above(region_ptr, slot, key, rel, floor, ASM: tl.constexpr):
    """region_ptr[slot] = key << 32 | rel where key > floor (one asm on a GPU: compare,
    address, store)."""
    if ASM:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b64 a, v; setp.gt.u32 p, $2, $4; "
            "mad.wide.s32 a, $1, 8, $5; mov.b64 v, {$3, $2}; @p st.global.b64 [a], v; mov.b32 $0, 0; }",
            "=r,r,r,r,r,l", [slot, key, rel, floor, region_ptr], dtype=tl.int32, is_pure=False, pack=1)
    else:
        _store_pairs(region_ptr, slot, key, rel, key > floor, False)


@triton.jit
def _place_at_least(region_ptr, key, pos, bound, n_gt, CAPW: tl.constexpr, T: tl.constexpr, ASM: tl.constexpr):
    """Store a tile's entries with key >= bound (>= 1) after the n_gt already in each
    warp's region; returns the new n_gt. Each thread counts its own and takes its slots
    after those of the lanes below it (one warp scan of 5 shuffles, `_warp_scan`): an
    entry's slot is then a register add, and only the kept entries (~1 in 16) are stored.

    A warp whose entries would run past its CAPW slots stores none of the tile (nor any
    later one: its count only grows). The pass has then failed (the caller retries or
    falls back), and the check is one compare a tile, not one an entry."""
    up = (key >= bound).to(tl.int32)
    before, total = _warp_scan(tl.sum(up, 0), T, ASM)
    floor = tl.where(n_gt + total <= CAPW, bound - 1, 0xFFFFFFFF)  # stored: key > floor
    _store_above(region_ptr, (n_gt + before)[None, :] + (tl.cumsum(up, 0) - up), key, pos, floor[None, :], ASM)
    return n_gt + total


@triton.jit
def _collect(row_ptr, hi, vlo, ties, regions, first, E: tl.constexpr, T: tl.constexpr, CAPW: tl.constexpr,
             VEC: tl.constexpr, ASM: tl.constexpr):
    """One pass over the decode row [0, hi) into the warps' CAPW-slot regions (key << 32 |
    position).
    Returns [T] tensors, each lane its warp's: (#entries above, #ties still in the region).

    Without `ties`, every entry >= vlo goes up from the bottom of its warp's region. With
    `ties` (the sample saw a run of equal keys at the bound, or a first pass overflowed):
    entries > vlo go up from the bottom, entries == vlo down from the top while they
    stay above every larger entry placed so far, so a run of ties cannot crowd out a
    larger key and a region need not hold the run (a later larger key may overwrite a
    tie).

    A step is an [E, T] tile (`_tile_positions`: thread t holds column t), placed by
    `_place_at_least`: no shared memory, no CTA-wide step. The whole tiles need no mask
    (the row's last, partial tile gets one); the next tile is loaded before the current
    one is sorted out. ~14 SASS instructions an entry on sm_90, load, key, count, scan
    and store included (a ballot an entry took ~33)."""
    CH: tl.constexpr = E * T
    region_ptr = regions + ((tl.arange(0, T) // 32) * CAPW)[None, :]
    n_gt = tl.zeros([T], dtype=tl.int32)  # each lane: its warp's entries above so far
    n_eq = tl.zeros([T], dtype=tl.int32)  # ties seen
    eq_room = tl.zeros([T], dtype=tl.int32) + CAPW  # ties stored: slots [eq_room, CAPW)
    ties = ties & (vlo < 0xFFFFFFFF)
    above = tl.where(ties, vlo + 1, vlo)  # entries that go up from the bottom: key >= above
    base = hi * 0
    bits = first  # the tile at 0, loaded by the caller
    # Two loops, not a branch a step: the registers of the ties' path would crowd the
    # hot loop's (its stores then wait on each other's address registers).
    if ties:
        while base < hi:
            pos = base + _tile_positions(E, T, VEC)
            key = _tile_keys(bits, pos, hi, base + CH > hi)
            bits = _load_tile(row_ptr, pos + CH, hi, VEC, ASM)
            n_gt = _place_at_least(region_ptr, key, pos, above, n_gt, CAPW, T, ASM)
            eq = key == vlo
            rank_eq, total_eq = _warp_rank(eq, E, T, ASM)
            slot_eq = CAPW - 1 - (n_eq[None, :] + (tl.cumsum(total_eq, 0) - total_eq) + rank_eq)
            keep_eq = eq & (slot_eq >= n_gt[None, :])
            n_eq += tl.sum(total_eq, 0)
            eq_room = tl.minimum(eq_room, tl.maximum(CAPW - n_eq, n_gt))
            _store_pairs(region_ptr, slot_eq, key, pos, keep_eq, ASM)
            base += CH
    else:
        # The whole tiles, no mask; then the row's last tile, if partial.
        whole = hi - hi % CH
        while base < whole:
            pos = base + _tile_positions(E, T, VEC)
            key = _tile_keys(bits, pos, hi, False)
            bits = _load_tile(row_ptr, pos + CH, hi, VEC, ASM)
            n_gt = _place_at_least(region_ptr, key, pos, above, n_gt, CAPW, T, ASM)
            base += CH
        if base < hi:
            pos = base + _tile_positions(E, T, VEC)
            # Masked only after 16-byte loads: 4-byte ones read key 0 from hi on.
            n_gt = _place_at_least(region_ptr, _tile_keys(bits, pos, hi, VEC), pos, above, n_gt, CAPW, T, ASM)
    # Ties below the final count of larger entries were overwritten by them.
    return n_gt, CAPW - tl.maximum(eq_room, n_gt)


@triton.jit
def _load_kept(ptrs, valid, ASM: tl.constexpr):
    """(key, position) of the candidates at `ptrs` ((0, -1) where not valid). Written by
    this program before a barrier: an L2 load (`.cg`), never the read-only path."""
    if ASM:
        key, pos = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $3, 0; mov.b32 $0, 0; mov.b32 $1, -1; "
            "@p ld.global.cg.v2.b32 {$1, $0}, [$2]; }",
            "=r,=r,l,r", [ptrs, valid.to(tl.int32)], dtype=(tl.uint32, tl.int32), is_pure=True, pack=1)
        return key, pos
    else:
        packed = tl.load(ptrs, mask=valid, other=0)
        return tl.where(valid, (packed.to(tl.uint64, bitcast=True) >> 32).to(tl.uint32), 0), \
            tl.where(valid, packed.to(tl.int32), -1)


@triton.jit
def _exclusive_over_warps(a, b, T: tl.constexpr, ASM: tl.constexpr):
    """[T] pairs, each lane its warp's (a, b) -> each lane the sums over the warps before
    its own. On a GPU one asm: lane 0 of each warp stores its pair in shared memory, a
    barrier, each thread adds the pairs of the warps before its own. Elsewhere one
    CTA-wide scan of both, packed in an int64."""
    if ASM:
        return tl.inline_asm_elementwise(_exclusive_over_warps_asm(T // 32), "=r,=r,r,r", [a, b],
                                         dtype=(tl.int32, tl.int32), is_pure=False, pack=1)
    else:
        lane = (tl.arange(0, T) % 32).to(tl.int64)
        packed = a.to(tl.int64) + (b.to(tl.int64) << 32)
        before = (tl.cumsum(packed, 0) - (lane + 1) * packed) // 32
        return (before & 0xFFFFFFFF).to(tl.int32), (before >> 32).to(tl.int32)


@triton.constexpr_function
def _exclusive_over_warps_asm(warps):
    """$2, $3: the warp's pair; out $0, $1: the sums over the warps before it."""
    asm = ("{ .reg .pred p, q; .reg .b32 w, a, x, y, s, u; .shared .align 8 .b32 pairs[" + str(2 * warps) + "]; "
           "mov.u32 a, %laneid; setp.eq.u32 p, a, 0; mov.u32 w, %tid.x; shr.u32 w, w, 5; mov.u32 a, pairs; "
           "mad.lo.u32 x, w, 8, a; @p st.shared.v2.b32 [x], {$2, $3}; bar.sync 0; mov.b32 s, 0; mov.b32 u, 0; ")
    for i in range(warps - 1):
        asm += ("ld.shared.v2.b32 {x, y}, [a+" + str(8 * i) + "]; setp.gt.u32 q, w, " + str(i)
                + "; @q add.s32 s, s, x; @q add.s32 u, u, y; ")
    return asm + "mov.b32 $0, s; mov.b32 $1, u; }"


@triton.jit
def _places(flag_a, flag_b, E: tl.constexpr, T: tl.constexpr, ASM: tl.constexpr):
    """Each [E, T] entry's rank among the entries with its flag set, in (warp, register,
    lane) order, for two flags at once: ballots within a warp, one scan over the warps."""
    rank_a, total_a = _warp_rank(flag_a, E, T, ASM)
    rank_b, total_b = _warp_rank(flag_b, E, T, ASM)
    base_a, base_b = _exclusive_over_warps(tl.sum(total_a, 0), tl.sum(total_b, 0), T, ASM)
    return (base_a[None, :] + tl.cumsum(total_a, 0) - total_a + rank_a,
            base_b[None, :] + tl.cumsum(total_b, 0) - total_b + rank_b)


@triton.jit
def _store_where(ptr, idx, val, flag, ASM: tl.constexpr):
    """ptr[idx] = val where flag (an asm on a GPU: the operands keep their layout)."""
    if ASM:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b64 a; setp.ne.b32 p, $3, 0; mad.wide.s32 a, $1, 4, $4; @p st.global.b32 [a], $2; "
            "mov.b32 $0, 0; }",
            "=r,r,r,r,l", [idx, val, flag.to(tl.int32), ptr], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.store(ptr + idx, val, mask=flag)


# -- CTA-wide steps through shared memory (GPU) ---------------------------------------
# Triton's cross-warp reduction takes three barriers and two shared-memory round trips,
# and a layout conversion follows it (~0.8 us a search round at 16 warps, H100); these
# take one barrier. A scalar asm declares a static shared buffer and returns its address
# (`_shared_buffer`: each call site its own buffer); a [T] asm stores the threads' values
# (thread t: element t) and waits at the barrier; a [32] asm reads the warps' values
# back (a [32] tensor holds element j in lane j of every warp, so its reduction to a
# scalar stays inside the warp: one REDUX, no barrier). The sm_90 compile test checks
# both layouts. A buffer that one call site uses again (a loop) needs a barrier between
# one round's reads and the next round's writes: the search rounds alternate between
# two halves of theirs, so the other half's barrier stands between.
# (The asm builders below are constexpr functions: their bodies may not call methods, so
# no str.format or str.join.)
@triton.constexpr_function
def _shared_buffer_asm(words):
    return "{ .shared .align 16 .b32 buf[" + str(words) + "]; mov.u32 $0, buf; }"


@triton.jit
def _shared_buffer(words: tl.constexpr, ASM: tl.constexpr):
    """The shared address of a static buffer of `words` 32-bit words on a GPU (the
    program id is an unused operand that makes the asm a scalar one); 0 elsewhere (the
    portable path takes no buffer)."""
    if ASM:
        return tl.inline_asm_elementwise(_shared_buffer_asm(words), "=r,r", [tl.program_id(0)], dtype=tl.int32,
                                         is_pure=False, pack=1)
    else:
        return 0


# $1 the thread's value, $2 the buffer: word tid = warp * 32 + lane.
_PUT_AND_WAIT_ASM = tl.constexpr(
    "{ .reg .b32 a; mov.u32 a, %tid.x; mad.lo.u32 a, a, 4, $2; st.shared.b32 [a], $1; bar.sync 0; mov.b32 $0, 0; }")


# Three values a thread -> each warp's three at words 4w..4w+2 of the buffer ($1..$3
# the values, $4 the buffer), then the barrier. _PUT3_ASM: the values are one a warp
# already; _PUT3_MIN_MAX_MAX_ASM: the warp's min, max, max of them (uint32).
_PUT3_TAIL = ("mov.u32 a, %laneid; setp.eq.u32 p, a, 0; mov.u32 a, %tid.x; shr.u32 a, a, 5; mad.lo.u32 a, a, 16, $4; "
              "@p st.shared.v4.b32 [a], {x, y, z, x}; bar.sync 0; mov.b32 $0, 0; }")
_PUT3_ASM = tl.constexpr("{ .reg .pred p; .reg .b32 a, x, y, z; mov.b32 x, $1; mov.b32 y, $2; mov.b32 z, $3; "
                         + _PUT3_TAIL)
_PUT3_MIN_MAX_MAX_ASM = tl.constexpr(
    "{ .reg .pred p; .reg .b32 a, x, y, z; redux.sync.min.u32 x, $1, 0xffffffff; "
    "redux.sync.max.u32 y, $2, 0xffffffff; redux.sync.max.u32 z, $3, 0xffffffff; " + _PUT3_TAIL)


@triton.constexpr_function
def _get3_asm(warps, empty_a, empty_b, empty_c):
    """Lane j < warps: warp j's three values (`_PUT3_ASM`); the other lanes: the empties
    ($3 the lane's element of a [32] tensor, $4 the buffer)."""
    return ("{ .reg .pred p; .reg .b32 a; mov.u32 a, %laneid; setp.lt.u32 p, a, " + str(warps) + "; "
            + "mov.b32 $0, " + empty_a + "; mov.b32 $1, " + empty_b + "; mov.b32 $2, " + empty_c + "; "
            + "mad.lo.u32 a, a, 16, $4; @p ld.shared.v2.b32 {$0, $1}, [a]; @p ld.shared.b32 $2, [a+8]; }")


@triton.jit
def _cta_min_max_max(a, b, c, T: tl.constexpr, ASM: tl.constexpr):
    """(min a, max b, max c) over a [T] tile of uint32: scalars."""
    if ASM:
        buf = _shared_buffer(4 * (T // 32), ASM)
        tl.inline_asm_elementwise(_PUT3_MIN_MAX_MAX_ASM, "=r,r,r,r,r", [a, b, c, buf],
                                  dtype=tl.int32, is_pure=False, pack=1)
        x, y, z = tl.inline_asm_elementwise(_get3_asm(T // 32, "0xFFFFFFFF", "0", "0"), "=r,=r,=r,r,r",
                                            [tl.arange(0, 32), buf], dtype=(tl.uint32, tl.uint32, tl.uint32),
                                            is_pure=False, pack=1)
        return tl.min(x, 0), tl.max(y, 0), tl.max(z, 0)
    else:
        return _min_max_max_axis0(a, b, c, ASM)


@triton.jit
def _warps_sum_max_max(a, b, c, T: tl.constexpr, ASM: tl.constexpr):
    """(sum, max, max) over the warps of [T] int32 values that each lane holds for its
    warp (32 copies of each): scalars."""
    if ASM:
        buf = _shared_buffer(4 * (T // 32), ASM)
        tl.inline_asm_elementwise(_PUT3_ASM, "=r,r,r,r,r", [a, b, c, buf], dtype=tl.int32,
                                  is_pure=False, pack=1)
        x, y, z = tl.inline_asm_elementwise(_get3_asm(T // 32, "0", "0", "0"), "=r,=r,=r,r,r",
                                            [tl.arange(0, 32), buf], dtype=(tl.int32, tl.int32, tl.int32),
                                            is_pure=False, pack=1)
        return tl.sum(x, 0), tl.max(y, 0), tl.max(z, 0)
    else:  # (three native reductions: `_min_max_max_axis0`)
        return tl.sum(a, 0) // 32, tl.max(b, 0), tl.max(c, 0)


# _lane_bins' asm: $1 key, $2 lo_k, $3 hi_k, $4 sh, $5..$9 the lane's masks m_0..m_4.
_BIT_BALLOT = "and.b32 t, d, {}; setp.ne.b32 q, t, 0; vote.sync.ballot.b32 b, q, 0xffffffff; xor.b32 b, b, ${}; and.b32 v, v, b; "
_HIST32_ASM = tl.constexpr(
    "{ .reg .pred p, q; .reg .b32 d, v, b, t; "
    "setp.ge.u32 p, $1, $2; setp.le.and.u32 p, $1, $3, p; sub.u32 d, $1, $2; shr.b32 d, d, $4; min.u32 d, d, 31; "
    "vote.sync.ballot.b32 v, p, 0xffffffff; "
    + "".join(_BIT_BALLOT.format(1 << j, 5 + j) for j in range(5))
    + "popc.b32 $0, v; }"
)


@triton.jit
def _lane_bins(key, lo_k, hi_k, sh, T: tl.constexpr):
    """[T]: lane j holds its warp's count of bin j of the 32-bin histogram of `key` in
    [lo_k, hi_k] (bin min((key - lo_k) >> sh, 31)), on a GPU.

    Each lane counts its own bin in each register: a ballot of the keys in range and one
    of each of the digit's five bits, the lane's bin the AND of those ballots or their
    complements (by the lane's bits), then a popc: ~22 SASS instructions a register,
    against ~41 for `tl.histogram` (the same ballots plus its shared-memory atomics)."""
    lane = tl.arange(0, T) % 32
    # m_j: 0 where the lane's bit j is set (keep the ballot), all ones where not (invert it).
    m0 = tl.where((lane & 1) != 0, 0, -1)[None, :]
    m1 = tl.where((lane & 2) != 0, 0, -1)[None, :]
    m2 = tl.where((lane & 4) != 0, 0, -1)[None, :]
    m3 = tl.where((lane & 8) != 0, 0, -1)[None, :]
    m4 = tl.where((lane & 16) != 0, 0, -1)[None, :]
    count = tl.inline_asm_elementwise(
        _HIST32_ASM, "=r,r,r,r,r,r,r,r,r,r", [key, lo_k, hi_k, sh, m0, m1, m2, m3, m4], dtype=tl.int32, is_pure=True,
        pack=1)
    return tl.sum(count, 0)


# _ranked_bin's asm, a [32] tensor: $3 the lane's element (unused), $4 the buffer of the
# warps' counts (`_lane_bins`, word w * 32 + j), $5 c_above, $6 target; out $0 digit, $1
# # in the bins above it, $2 # in it. h: bin j's count over the warps (lane j); s: suffix
# sums by shuffles down; the lanes whose c_above + s reaches the target are 0..digit (s
# never grows with the lane).
_SUFFIX_STEP = "shfl.sync.down.b32 t|p, s, {}, 0x1f, 0xffffffff; @p add.s32 s, s, t; "
_PICK_TAIL = tl.constexpr(
    "mov.b32 s, h; " + "".join(_SUFFIX_STEP.format(1 << j) for j in range(5))
    + "add.s32 t, s, $5; setp.ge.s32 q, t, $6; vote.sync.ballot.b32 b, q, 0xffffffff; bfind.u32 g, b; max.s32 g, g, 0; "
    "shfl.sync.idx.b32 $2, h, g, 0x1f, 0xffffffff; shfl.sync.idx.b32 t, s, g, 0x1f, 0xffffffff; "
    "sub.s32 $1, t, $2; mov.b32 $0, g; }")


@triton.constexpr_function
def _gather_pick_asm(warps):
    asm = ("{ .reg .pred p, q; .reg .b32 a, h, s, t, b, g; mov.u32 a, %laneid; mad.lo.u32 a, a, 4, $4; "
           "ld.shared.b32 h, [a]; ")
    for w in range(1, warps):
        asm += "ld.shared.b32 t, [a+" + str(128 * w) + "]; add.s32 h, h, t; "
    return asm + _PICK_TAIL


@triton.jit
def _ranked_bin(key, lo_k, hi_k, sh, c_above, target, buf, E2: tl.constexpr, T: tl.constexpr, ASM: tl.constexpr):
    """One radix round over the [E2, T] tile `key`: (digit, above, n) with digit the
    largest bin j of the 32-bin histogram of the keys in [lo_k, hi_k] (bin
    min((key - lo_k) >> sh, 31)) where c_above + #(keys in bins >= j) >= target (0 if
    none), above = #(keys in bins > digit), n = #(keys in bin digit); scalars.

    On a GPU: `_lane_bins`, then one CTA-wide step through shared memory at `buf` (2 KB
    at 16 warps): each lane sums its bin over the warps, the suffix sums are warp
    shuffles and the digit a ballot; one barrier a round. Elsewhere `tl.histogram`."""
    if ASM:
        tl.inline_asm_elementwise(_PUT_AND_WAIT_ASM, "=r,r,r", [_lane_bins(key, lo_k, hi_k, sh, T), buf],
                                  dtype=tl.int32, is_pure=False, pack=1)
        digit, above, n = tl.inline_asm_elementwise(
            _gather_pick_asm(T // 32), "=r,=r,=r,r,r,r,r", [tl.arange(0, 32), buf, c_above, target],
            dtype=(tl.int32, tl.int32, tl.int32), is_pure=False, pack=1)
        return tl.max(digit, 0), tl.max(above, 0), tl.max(n, 0)
    else:
        inside = (key >= lo_k) & (key <= hi_k)
        hist = tl.histogram(tl.reshape(tl.minimum((key - lo_k) >> sh.to(tl.uint32), 31).to(tl.int32), [E2 * T]), 32,
                            mask=tl.reshape(inside, [E2 * T]))
        bins = tl.arange(0, 32)
        digit = tl.max(tl.where(c_above + tl.cumsum(hist, 0, reverse=True) >= target, bins, 0), axis=0)
        return digit, tl.sum(tl.where(bins > digit, hist, 0), axis=0), tl.sum(tl.where(bins == digit, hist, 0), axis=0)


@triton.jit
def _span_shift(span):
    """max(bit length of span - 5, 0): the shift that puts [0, span] in 32 bins (the
    float's exponent gives the top bit, rounding may give one more: fewer bins used)."""
    top = ((span.to(tl.float32).to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127
    return tl.where(span > 0, tl.maximum(top - 4, 0), 0)


@triton.jit
def _search_round(key, lo_k, hi_k, sh, c_above, topk, buf, EX: tl.constexpr, T: tl.constexpr, ASM: tl.constexpr):
    """One round of the search: the bin of [lo_k, hi_k] (32 bins of 2^sh keys, the last
    one running to hi_k) where the count from the top, with the c_above keys above,
    reaches topk (`_ranked_bin`, exchanging through `buf`). Returns the bin as the new
    (lo_k, hi_k, sh, c_above, n_bin)."""
    digit, above, n_bin = _ranked_bin(key, lo_k, hi_k, sh, c_above, topk, buf, EX, T, ASM)
    lo_k = lo_k + (digit.to(tl.uint32) << sh.to(tl.uint32))
    # Bin 31 runs to hi_k; the others are 2^sh keys wide (never past 2^32 - 1).
    hi_k = tl.where(digit == 31, hi_k, lo_k + tl.minimum(hi_k - lo_k, ((1 << sh) - 1).to(tl.uint32)))
    return lo_k, hi_k, _span_shift(hi_k - lo_k), c_above + above, n_bin


@triton.jit
def _search_and_place(key, pos, lo_k, hi_k, sh, c_above, n_bin, c_start, hi_start, topk, out_row, buf, half,
                      EX: tl.constexpr, T: tl.constexpr, ASM: tl.constexpr):
    """Finish the search (state lo_k, hi_k, sh, c_above, n_bin: `_search_round`'s) over
    `key` ([EX, T]: the keys in [lo_k, hi_k] among others, 0 = no key) and write its part
    of the top-k: its keys in (final hi_k, hi_start] at c_start.. (the c_start keys above
    hi_start are placed already), then the first topk - (#keys above the final bin) of
    the bin. The rounds exchange through `buf`'s two halves, starting with `half`.
    Returns the rounds run."""
    rounds = topk * 0
    while (c_above + n_bin > topk) & (hi_k > lo_k):
        lo_k, hi_k, sh, c_above, n_bin = _search_round(key, lo_k, hi_k, sh, c_above, topk,
                                                       buf + ((rounds + half) % 2) * T * 4, EX, T, ASM)
        rounds += 1
    above = (key > hi_k) & (key <= hi_start)
    in_bin = (key >= lo_k) & (key <= hi_k)
    place_a, place_b = _places(above, in_bin, EX, T, ASM)
    place_b += c_above
    _store_where(out_row, tl.where(above, c_start + place_a, place_b), pos, above | (in_bin & (place_b < topk)), ASM)
    return rounds


@triton.jit
def _store_pairs(ptr, idx, key, pos, flag, ASM: tl.constexpr):
    """ptr[idx] = key << 32 | pos where flag (int64 slots)."""
    if ASM:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b64 a, v; setp.ne.b32 p, $4, 0; mad.wide.s32 a, $1, 8, $5; mov.b64 v, {$3, $2}; "
            "@p st.global.b64 [a], v; mov.b32 $0, 0; }",
            "=r,r,r,r,r,l", [idx, key, pos, flag.to(tl.int32), ptr], dtype=tl.int32, is_pure=False, pack=1)
    else:
        packed = (key.to(tl.uint64) << 32) | pos.to(tl.uint32).to(tl.uint64)
        tl.store(ptr + idx, packed.to(tl.int64, bitcast=True), mask=flag)


@triton.jit
def _store_pairs_shared(buf, idx, key, pos, flag):
    """(pos, key) to 8-byte slot idx of the shared buffer at `buf` where flag (GPU)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 a; setp.ne.b32 p, $4, 0; mad.lo.u32 a, $1, 8, $5; "
        "@p st.shared.v2.b32 [a], {$3, $2}; mov.b32 $0, 0; }",
        "=r,r,r,r,r,r", [idx, key, pos, flag.to(tl.int32), buf], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _load_pairs_shared(buf, idx, valid):
    """(key, pos) of 8-byte slot idx of the shared buffer at `buf` ((0, -1) where not
    valid; GPU)."""
    key, pos = tl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 a; setp.ne.b32 p, $3, 0; mov.b32 $0, 0; mov.b32 $1, -1; mad.lo.u32 a, $2, 8, $4; "
        "@p ld.shared.v2.b32 {$1, $0}, [a]; }",
        "=r,=r,r,r,r", [idx, valid.to(tl.int32), buf], dtype=(tl.uint32, tl.int32), is_pure=False, pack=1)
    return key, pos


@triton.jit
def _select_kept(regions, n_gt, n_eq, n_kept, vlo, smax, topk, out_row, E2: tl.constexpr, T: tl.constexpr,
                 CAPW: tl.constexpr, ASM: tl.constexpr, STOP: tl.constexpr = 9):
    """Write the top-k of the regions' entries (warp w's region: n_gt[w] entries at the
    bottom, n_eq[w] at the top; n_kept in all, >= topk; every one >= vlo) to
    out_row[:topk]. Only the first E2 * 32 slots of a region are read: the caller makes
    sure they hold every entry. Returns rounds * 2 + (1 if the bin was moved to a small
    tile) (tests, profiles).

    Warp w holds its own region, slot e * 32 + lane in register e: [E2, T].
    A search narrows an interval [lo_k, hi_k] of keys that holds the topk-th largest: a
    round histograms the interval's keys in 32 bins of 2^sh keys (the last bin also
    takes every key above) and keeps the bin where the count from the top reaches topk,
    until the keys above the bin and in it are exactly topk or the bin is one key. The
    first round's bins span [vlo, smax], the sample's largest key (no CTA-wide max of
    the kept keys). Every key > hi_k is written, then the first topk - (#keys > hi_k)
    of the bin, each entry's place from ballots.

    A round costs about the same for any number of keys in the interval: after the
    first one (a few hundred keys left in the bin of ~3000) the bin's keys are moved to
    shared memory (the scratch's first slots in the interpreter) and read back as a
    [CX, T] tile, CX = 2 (8x fewer ballots than E2 = 8 a round), unless more than 2 * T
    keys are left. The rounds exchange their histograms through a shared buffer's two
    halves in turn (`_ranked_bin`). STOP (3, 4): the kernel's UNTIL (profiles)."""
    lane = tl.arange(0, T)
    slot = tl.arange(0, E2)[:, None] * 32 + (lane % 32)[None, :]
    valid = ((slot < n_gt[None, :]) | (slot >= CAPW - n_eq[None, :])) & (slot < CAPW)
    key, pos = _load_kept(regions + ((lane // 32) * CAPW)[None, :] + slot, valid, ASM)
    lo_k = vlo  # every kept key is >= vlo >= 1; key 0 marks no entry
    hi_k = tl.full([], 0xFFFFFFFF, tl.uint32)
    sh = _span_shift(tl.maximum(smax, vlo) - vlo)
    c_above = topk * 0  # keys > hi_k
    n_bin = n_kept  # keys in [lo_k, hi_k]
    rounds = topk * 0
    buf = _shared_buffer(2 * T, ASM)  # the rounds' exchanges, two halves (`_ranked_bin`)
    if STOP == 3:
        tl.store(out_row + lane, hi_k + n_bin + sh + tl.sum(pos, 0))
        return rounds
    CX: tl.constexpr = 2
    if (c_above + n_bin > topk) & (hi_k > lo_k):
        lo_k, hi_k, sh, c_above, n_bin = _search_round(key, lo_k, hi_k, sh, c_above, topk, buf, E2, T, ASM)
        rounds = 1
    if STOP == 4:
        tl.store(out_row + lane, hi_k + n_bin + sh + tl.sum(pos, 0) + lo_k)
        return rounds
    if (rounds == 1) & (c_above + n_bin > topk) & (hi_k > lo_k) & (n_bin <= CX * T):
        # The keys above the bin are final: written from here. The bin's keys go to a
        # small buffer (shared memory on a GPU; the scratch's first slots elsewhere: every
        # warp has read its region, the round took a barrier) and come back as a small
        # tile.
        above = key > hi_k
        in_bin = (key >= lo_k) & (key <= hi_k)
        place_a, place_b = _places(above, in_bin, E2, T, ASM)
        _store_where(out_row, place_a, pos, above, ASM)
        idx = tl.arange(0, CX)[:, None] * T + lane[None, :]
        if ASM:
            moved = _shared_buffer(2 * CX * T, ASM)
            _store_pairs_shared(moved, place_b, key, pos, in_bin)
            tl.debug_barrier()
            key_c, pos_c = _load_pairs_shared(moved, idx, idx < n_bin)
        else:
            _store_pairs(regions, place_b, key, pos, in_bin, ASM)
            tl.debug_barrier()
            key_c, pos_c = _load_kept(regions + idx, idx < n_bin, ASM)
        rounds += _search_and_place(key_c, pos_c, lo_k, hi_k, sh, c_above, n_bin, c_above, hi_k, topk, out_row,
                                    buf, rounds, CX, T, ASM)
        rounds = rounds * 2 + 1
    else:
        # No round needed, one was enough, or a large bin: the whole tile, every key
        # placed here (the ones above the first bin too).
        rounds += _search_and_place(key, pos, lo_k, hi_k, sh, c_above, n_bin, c_above * 0,
                                    tl.full([], 0xFFFFFFFF, tl.uint32), topk, out_row, buf, rounds, E2, T, ASM)
        rounds = rounds * 2
    return rounds


@triton.constexpr_function
def _HALF_E2(capw):
    """Registers a thread for the lower half of a CAPW-slot region (>= 1)."""
    return max((capw // 2 + 31) // 32, 1)


@triton.jit(do_not_specialize=["topk"])
def _rowwise_kernel(
    logits_ptr, stride_lr, seq_lens_ptr, next_n, width, topk, out_ptr, stride_or, out_cols,
    cand_ptr, stride_cr, meta_ptr, stride_mr,
    S: tl.constexpr, Z: tl.constexpr, RETRY_Z: tl.constexpr, E: tl.constexpr, NW: tl.constexpr, CAPW: tl.constexpr,
    LBLOCK: tl.constexpr, VEC: tl.constexpr, ASM: tl.constexpr, UNTIL: tl.constexpr = 9,
):
    """Decode top-k of one row a program: sample, collect, select (module docstring).
    UNTIL stops early for profiles: after the sample (1), the collect pass (2), the
    regions' reload (3) or the first search round (4); the indices are then not valid."""
    T: tl.constexpr = 32 * NW
    row = tl.program_id(0)
    # Decode rows start at column 0: lo = shift = 0.
    lo, hi, shift = row_bounds(row, seq_lens_ptr, seq_lens_ptr, seq_lens_ptr, next_n, width, True)
    n = hi - lo
    out_row = out_ptr + row.to(tl.int64) * stride_or
    if n <= topk:
        # Short row: every valid position, then -1; no data needed.
        write_positions(out_row, 0, n, lo - shift, out_cols, LBLOCK)
    else:
        row_ptr = logits_ptr + row.to(tl.int64) * stride_lr
        regions = cand_ptr + row.to(tl.int64) * stride_cr  # NW regions of CAPW slots
        attempt = n * 0
        why = attempt
        z = Z + 0.0 * attempt
        vlo = attempt.to(tl.uint32)
        smax = vlo
        n_gt = tl.zeros([T], dtype=tl.int32)
        n_eq = n_gt
        n_kept = attempt
        max_gt = attempt
        max_eq = attempt
        while (attempt < 2) & (why != 1):
            vlo, ties, smax, first = _sample_bound(row_ptr, lo, hi, topk, z, S // T, E, T, VEC, ASM)
            if UNTIL >= 2:
                # [T]: each lane its warp's counts; ties also after a first pass overflowed.
                n_gt, n_eq = _collect(row_ptr, hi, vlo, ties | (why == 2), regions, first, E, T, CAPW, VEC, ASM)
            else:
                n_gt = tl.zeros([T], dtype=tl.int32) + topk // NW + 1 + (vlo & 1).to(tl.int32)
            # One CTA-wide step: every lane holds its warp's counts. (Its shared buffer is
            # written again only in a second attempt, after the sample's barriers.)
            n_kept, max_gt, max_eq = _warps_sum_max_max(n_gt + n_eq, n_gt, n_eq, T, ASM)
            why = tl.where(max_gt > CAPW, 2, tl.where(n_kept < topk, 0, 1))
            # A second pass moves the bound the way the first one missed.
            z = tl.where(why == 0, RETRY_Z, 0.5 * Z)
            attempt += 1
        search = attempt * 0  # rounds * 2 + moved to a small tile
        if UNTIL < 3:
            pass
        elif why == 1:
            # Every entry of the row >= vlo (> vlo with ties at the bound) is in the
            # regions, >= topk of them: their top-k is the row's. The barrier makes the
            # other warps' regions visible.
            tl.debug_barrier()
            # Most rows: the regions' lower halves hold everything (half the work).
            if (max_gt <= CAPW // 2) & (max_eq == 0):
                search = _select_kept(regions, n_gt, n_eq, n_kept, vlo, smax, topk, out_row, _HALF_E2(CAPW), T, CAPW,
                                      ASM, UNTIL)
            else:
                search = _select_kept(regions, n_gt, n_eq, n_kept, vlo, smax, topk, out_row, (CAPW + 31) // 32, T,
                                      CAPW, ASM, UNTIL)
        else:
            select_row(row_ptr, lo, hi, shift, topk, out_row, LBLOCK)
        write_positions(out_row, topk, 0, 0, out_cols, LBLOCK)  # -1 past topk
        # Each warp's (vlo, #entries above, #ties at the top, search * 16 + passes * 4 +
        # outcome): tests and profiles (`graphsafe.ops.topk.cases.rowwise_outcomes`).
        meta = meta_ptr + row.to(tl.int64) * stride_mr + (tl.arange(0, T) // 32) * _NMETA
        tl.store(meta, tl.zeros([T], dtype=tl.int32) + vlo.to(tl.int32, bitcast=True))
        tl.store(meta + 1, n_gt)
        tl.store(meta + 2, n_eq)
        tl.store(meta + 3, tl.zeros([T], dtype=tl.int32) + search * 16 + attempt * 4 + why)

