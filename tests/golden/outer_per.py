# triton_per_fused_0: computes mul, sum
@triton_heuristics.persistent_reduction(size_hints={'x': 512, 'r0_': 64}, reduction_hint=ReductionHint.OUTER, signature={'in_ptr0': '*fp32', 'out_ptr0': '*fp32', 'xnumel': 'i32', 'r0_numel': 'i32'})
@triton.jit
def triton_per_fused_0(in_ptr0, out_ptr0, xnumel, r0_numel, XBLOCK : tl.constexpr):
    xnumel = 512
    r0_numel = 64
    R0_BLOCK: tl.constexpr = 64
    rnumel = r0_numel
    RBLOCK: tl.constexpr = R0_BLOCK
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[None, :]
    xmask = xindex < xnumel
    r0_index = tl.arange(0, R0_BLOCK)[:, None]
    r0_offset = 0
    r0_mask = tl.full([R0_BLOCK], True, tl.int1)[:, None]
    roffset = r0_offset
    rindex = r0_index
    r0_1 = r0_index
    x0 = xindex
    tmp0 = tl.load(in_ptr0 + (512*r0_1 + x0), xmask, eviction_policy='evict_first', other=0.0)
    tmp1 = (tmp0 * tmp0)
    tmp2 = tl.broadcast_to(tmp1, [R0_BLOCK, XBLOCK])
    tmp3 = tl.where(xmask, tmp2, 0)
    tmp4 = tl.sum(tmp3, 0)[None, :].to(tl.float32)
    tl.store(out_ptr0 + (x0), tmp4, xmask)
