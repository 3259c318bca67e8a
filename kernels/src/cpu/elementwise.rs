//! Row-wise and element-wise kernels: RMSNorm, residual add, RoPE (rotate-half, with llama3 and
//! linear frequency scaling) and SiLU·mul. All f32, matching PyTorch's f32 formulas.

/// `out[r] = x[r] / sqrt(mean(x[r]²) + eps) * weight` for every row `r` of width `weight.len()`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    assert!(d > 0 && x.len().is_multiple_of(d), "x must be [rows, {d}]");
    assert_eq!(x.len(), out.len(), "out must match x");
    for (row, out_row) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let sum_sq: f32 = row.iter().map(|v| v * v).sum();
        let inv = 1.0 / (sum_sq / d as f32 + eps).sqrt();
        for ((o, v), w) in out_row.iter_mut().zip(row).zip(weight) {
            *o = w * (v * inv);
        }
    }
}

/// `acc += x`, element-wise.
pub fn add_in_place(acc: &mut [f32], x: &[f32]) {
    assert_eq!(acc.len(), x.len(), "lengths must match");
    for (a, v) in acc.iter_mut().zip(x) {
        *a += v;
    }
}

/// `out[r, i] = silu(gate_up[r, i]) * gate_up[r, d + i]` where each row of `gate_up` is
/// `[gate (d), up (d)]` and `d = out row width`.
pub fn silu_mul(gate_up: &[f32], out: &mut [f32], d: usize) {
    assert!(d > 0 && out.len().is_multiple_of(d), "out must be [rows, {d}]");
    assert_eq!(gate_up.len(), out.len() * 2, "gate_up must be [rows, 2*{d}]");
    for (gu, o) in gate_up.chunks_exact(2 * d).zip(out.chunks_exact_mut(d)) {
        let (gate, up) = gu.split_at(d);
        for ((o, g), u) in o.iter_mut().zip(gate).zip(up) {
            *o = g / (1.0 + (-g).exp()) * u;
        }
    }
}

/// How RoPE frequencies are scaled for long contexts (`rope_scaling` in `config.json`).
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor` (frequencies divided by it).
    Linear {
        /// The scaling factor.
        factor: f32,
    },
    /// Llama 3.1's piecewise frequency scaling.
    Llama3 {
        /// Scaling factor for low frequencies.
        factor: f32,
        /// Wavelength threshold factor for low frequencies.
        low_freq_factor: f32,
        /// Wavelength threshold factor for high frequencies.
        high_freq_factor: f32,
        /// The context length the model was pre-trained with.
        original_max_position_embeddings: f32,
    },
}

/// The `head_dim / 2` inverse frequencies of rotate-half RoPE with base `theta`, scaled.
pub fn rope_inv_freq(head_dim: usize, theta: f32, scaling: &RopeScaling) -> Vec<f32> {
    assert!(head_dim.is_multiple_of(2), "head_dim must be even");
    let base: Vec<f32> = (0..head_dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32))
        .collect();
    match *scaling {
        RopeScaling::None => base,
        RopeScaling::Linear { factor } => base.into_iter().map(|f| f / factor).collect(),
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings: old } => {
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            base.into_iter()
                .map(|f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    }
}

/// Applies rotate-half RoPE in place to `x` = [tokens, heads, head_dim]; token `t` is at
/// `positions[t]`.
pub fn rope_in_place(x: &mut [f32], positions: &[usize], heads: usize, inv_freq: &[f32]) {
    let half = inv_freq.len();
    let head_dim = 2 * half;
    assert_eq!(x.len(), positions.len() * heads * head_dim, "x must be [tokens, heads, head_dim]");
    let mut cos = vec![0.0f32; half];
    let mut sin = vec![0.0f32; half];
    for (token, &pos) in x.chunks_exact_mut(heads * head_dim).zip(positions) {
        for ((c, s), f) in cos.iter_mut().zip(sin.iter_mut()).zip(inv_freq) {
            let angle = pos as f32 * f;
            *c = angle.cos();
            *s = angle.sin();
        }
        for head in token.chunks_exact_mut(head_dim) {
            let (a, b) = head.split_at_mut(half);
            for i in 0..half {
                let (x1, x2) = (a[i], b[i]);
                a[i] = x1 * cos[i] - x2 * sin[i];
                b[i] = x2 * cos[i] + x1 * sin[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_matches_formula() {
        let x = [1.0f32, -2.0, 3.0, 0.5, 4.0, -1.0];
        let w = [0.5f32, 2.0, 1.5];
        let mut out = [f32::NAN; 6];
        rms_norm(&x, &w, 1e-5, &mut out);
        for r in 0..2 {
            let row = &x[r * 3..r * 3 + 3];
            let ms: f64 = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / 3.0;
            for i in 0..3 {
                let want = row[i] as f64 / (ms + 1e-5).sqrt() * w[i] as f64;
                assert!((out[r * 3 + i] as f64 - want).abs() < 1e-6 * want.abs().max(1.0));
            }
        }
    }

    #[test]
    fn silu_mul_matches_formula() {
        let gu = [1.0f32, -3.0, 2.0, 0.5];
        let mut out = [f32::NAN; 2];
        silu_mul(&gu, &mut out, 2);
        let silu = |g: f64| g / (1.0 + (-g).exp());
        assert!((out[0] as f64 - silu(1.0) * 2.0).abs() < 1e-6);
        assert!((out[1] as f64 - silu(-3.0) * 0.5).abs() < 1e-6);
    }

    #[test]
    fn rope_rotates_pairs_and_keeps_norm() {
        let inv = rope_inv_freq(4, 10000.0, &RopeScaling::None);
        assert_eq!(inv.len(), 2);
        assert!((inv[1] - 0.01).abs() < 1e-7);
        let mut x = vec![1.0f32, 2.0, 3.0, 4.0];
        rope_in_place(&mut x, &[3], 1, &inv);
        let (c0, s0) = ((3.0f64).cos(), (3.0f64).sin());
        assert!((x[0] as f64 - (1.0 * c0 - 3.0 * s0)).abs() < 1e-5);
        assert!((x[2] as f64 - (3.0 * c0 + 1.0 * s0)).abs() < 1e-5);
        let norm: f32 = x.iter().map(|v| v * v).sum();
        assert!((norm - 30.0).abs() < 1e-4);
        let mut y = vec![1.0f32, 2.0, 3.0, 4.0];
        rope_in_place(&mut y, &[0], 1, &inv);
        assert_eq!(y, vec![1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0,
        };
        let plain = rope_inv_freq(128, 500000.0, &RopeScaling::None);
        let scaled = rope_inv_freq(128, 500000.0, &scaling);
        assert_eq!(plain[0], scaled[0]);
        assert!((scaled[63] - plain[63] / 8.0).abs() < 1e-12);
        assert!(scaled.iter().zip(&plain).all(|(s, p)| s <= p && *s >= p / 8.0 - 1e-12));
    }
}
