// cpp_fused_0: computes mul, add, cumsum
extern "C" void cpp_fused_0(const float* in_ptr0, float* out_ptr0)
{
    #pragma omp parallel for
    for (int64_t x0 = 0; x0 < 64; x0++) {
        float acc_buf0 = -0.0f;
        for (int64_t r0 = 0; r0 < 1000; r0++) {
            auto tmp0 = in_ptr0[r0 + 1000*x0];
            auto tmp1 = (tmp0 * 2.0f);
            auto tmp2 = (tmp1 + 1.0f);
            acc_buf0 = acc_buf0 + tmp2;
            out_ptr0[r0 + 1000*x0] = acc_buf0;
        }
    }
}
