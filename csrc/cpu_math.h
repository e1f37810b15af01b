/* Float32 helpers the CPU kernels share (csrc/cpu_*.c). */
#ifndef ROLLOUT_CPU_MATH_H
#define ROLLOUT_CPU_MATH_H

#include <stdint.h>

/* Sums that must not depend on a row's batch or memory (batch-invariant mode relies on them) run in LANES
 * partial sums, element i into lane i % LANES, then lanes_total's fixed tree. */
#define LANES 16

static inline float lanes_total(float lanes[LANES]) {
    for (int width = LANES / 2; width > 0; width /= 2)
        for (int i = 0; i < width; ++i) lanes[i] += lanes[i + width];
    return lanes[0];
}

/* exp(x) for x <= 0 in float32 to about 2 ulp: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p the degree-6
 * Taylor polynomial (its truncation error r^7/7! < 1.3e-7 relative). Plain arithmetic, so the loops that call it
 * vectorize (libm's expf would not without -ffast-math). Below -87.5 it returns 0 (float32's exp is under 1e-38
 * there). */
static inline float exp_nonpositive(float x) {
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    float clamped = x < -87.5f ? -87.5f : x;
    float n = (clamped * 1.44269504088896341f + shifter) - shifter;
    float r = clamped - n * 0.693145751953125f; /* ln2 in two parts keeps r exact */
    r = r - n * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { int32_t i; float f; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    float y = p * scale.f;
    return x < -87.5f ? 0.0f : y;
}

#endif
