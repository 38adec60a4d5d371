"""The CPU conv2d decision (issue 14 item 7): im2col + BLAS (numpy) against a C++ direct convolution.

    python bench/conv_cpu_choice.py                 # five ResNet-50 layer shapes, batch 1, float32
    python bench/conv_cpu_choice.py --batch 4 --runs 20

Stax's CPU conv2d is the im2col + matmul fallback kernel (stax/conv_numpy.py). This script records
why: it compiles a straightforward direct convolution in C++ (OpenMP over output channels, the
innermost loop along the output row, unit stride vectorized by the compiler with Stax's flags
`-O3 -march=native -fopenmp`), checks it against the fallback, and times both per shape (median
of `--runs` calls after a warm-up). Nothing here is part of Stax.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import cffi
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# name -> (C_in, H, W, C_out, K, stride, padding): torchvision's ResNet-50 (v1.5: stride on the 3x3)
RESNET50_SHAPES = {
    "conv1_7x7_s2": (3, 224, 224, 64, 7, 2, 3),
    "layer1_3x3": (64, 56, 56, 64, 3, 1, 1),
    "layer2_3x3_s2": (128, 56, 56, 128, 3, 2, 1),
    "layer3_1x1": (1024, 14, 14, 256, 1, 1, 0),
    "layer4_3x3": (512, 7, 7, 512, 3, 1, 1),
}

DIRECT_CPP = r"""
#include <stdint.h>
#include <string.h>
extern "C" void direct_conv(const float* x, const float* w, const float* b, float* out,
                            int64_t n, int64_t c, int64_t h, int64_t wd, int64_t co, int64_t k,
                            int64_t s, int64_t p, int64_t oh, int64_t ow) {
    #pragma omp parallel for collapse(2) schedule(static)
    for (int64_t img = 0; img < n; ++img)
    for (int64_t o = 0; o < co; ++o) {
        float* dst = out + (img * co + o) * oh * ow;
        for (int64_t i = 0; i < oh * ow; ++i) dst[i] = b[o];
        for (int64_t ci = 0; ci < c; ++ci) {
            const float* src = x + (img * c + ci) * h * wd;
            for (int64_t kh = 0; kh < k; ++kh)
            for (int64_t kw = 0; kw < k; ++kw) {
                const float wv = w[((o * c + ci) * k + kh) * k + kw];
                // the output columns whose input column lies inside the image
                int64_t lo = 0, hi = ow;
                while (lo < ow && lo * s - p + kw < 0) ++lo;
                while (hi > lo && (hi - 1) * s - p + kw >= wd) --hi;
                for (int64_t r = 0; r < oh; ++r) {
                    const int64_t ih = r * s - p + kh;
                    if (ih < 0 || ih >= h) continue;
                    const float* row = src + ih * wd - p + kw;
                    float* drow = dst + r * ow;
                    if (s == 1) {
                        for (int64_t q = lo; q < hi; ++q) drow[q] += wv * row[q];
                    } else {
                        for (int64_t q = lo; q < hi; ++q) drow[q] += wv * row[q * s];
                    }
                }
            }
        }
    }
}
"""


def _direct_lib():
    ffi = cffi.FFI()
    ffi.cdef("void direct_conv(const float*, const float*, const float*, float*, int64_t, int64_t, "
             "int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);")
    path = Path(tempfile.mkdtemp()) / "direct.cpp"
    path.write_text(DIRECT_CPP)
    so = path.with_suffix(".so")
    subprocess.run(["g++", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(path), "-o", str(so)],
                   check=True)
    return ffi, ffi.dlopen(str(so))


def _ms(fn, runs) -> tuple:
    """(median, min) milliseconds of `runs` calls after half a second of calls (the min is the
    steadier figure on a shared machine)."""
    t_end = time.perf_counter() + 0.5
    while time.perf_counter() < t_end:
        fn()
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts), 1e3 * min(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    from stax.conv_numpy import conv2d_numpy
    ffi, lib = _direct_lib()
    rng = np.random.default_rng(0)
    print(f"{'shape':16} {'im2col+BLAS ms median (min)':>28} {'C++ direct ms median (min)':>27} "
          f"{'direct/im2col (medians, mins)':>30}")
    for name, (c, h, wd, co, k, s, p) in RESNET50_SHAPES.items():
        x = rng.standard_normal((args.batch, c, h, wd), dtype=np.float32)
        w = rng.standard_normal((co, c, k, k), dtype=np.float32)
        b = rng.standard_normal(co, dtype=np.float32)
        oh, ow = (h + 2 * p - k) // s + 1, (wd + 2 * p - k) // s + 1
        out = np.empty((args.batch, co, oh, ow), np.float32)
        ptrs = [ffi.from_buffer("float[]", a) for a in (x, w, b, out)]
        run_direct = lambda: lib.direct_conv(*ptrs, args.batch, c, h, wd, co, k, s, p, oh, ow)
        run_im2col = lambda: conv2d_numpy(x, w, b, stride=(s, s), padding=((p, p), (p, p)), dilation=(1, 1), groups=1)
        run_direct()
        want = run_im2col()
        err = float(np.max(np.abs(out - want)) / (1 + np.max(np.abs(want))))
        assert err < 1e-4, (name, err)
        (im_med, im_min), (d_med, d_min) = _ms(run_im2col, args.runs), _ms(run_direct, args.runs)
        print(f"{name:16} {im_med:18.2f} ({im_min:7.2f}) {d_med:17.2f} ({d_min:7.2f}) "
              f"{d_med / im_med:21.2f}, {d_min / im_min:.2f}")


if __name__ == "__main__":
    main()
