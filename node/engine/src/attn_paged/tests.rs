//! The kernels' bit-for-bit checks across ISAs.

use super::*;

#[test]
fn exp16_equals_scalar_expf() {
    let xs: Vec<f32> = (-4000..200).map(|i| i as f32 * 0.05).chain([f32::NEG_INFINITY]).collect();
    for ch in xs.chunks(16) {
        let mut x = [0f32; L];
        x[..ch.len()].copy_from_slice(ch);
        let want: Vec<u32> = x.iter().map(|&v| ggml_expf(v - 0.5).to_bits()).collect();
        let bits = |x: &[f32; L]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f,avx2,fma,f16c")]
            unsafe fn avx512(x: &mut [f32; L]) {
                exp16::<isa::x86::Avx512>(x, 0.5)
            }
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn avx2(x: &mut [f32; L]) {
                exp16::<isa::x86::Avx2>(x, 0.5)
            }
            let mut y = x;
            if kind() == Kind::Avx512 {
                // SAFETY: detected.
                unsafe { avx512(&mut y) };
                assert_eq!(bits(&y), want, "avx512");
            }
            let mut y = x;
            if kind() != Kind::Scalar {
                // SAFETY: detected.
                unsafe { avx2(&mut y) };
                assert_eq!(bits(&y), want, "avx2");
            }
        }
        exp16::<Scalar>(&mut x, 0.5);
        assert_eq!(bits(&x), want);
    }
}

/// Every ISA this CPU has gives the scalar path's bits, on shapes with
/// head dims 64 and 256 (vectorised orders), 8 and 80 (fallback), a
/// window, decode and prefill rows, and several sequences.
#[test]
fn isas_are_bit_identical() {
    for (nh, nkv, hd, window) in
        [(6, 2, 64, usize::MAX), (4, 1, 256, 40), (2, 1, 8, usize::MAX), (2, 2, 80, 30)]
    {
        let bsz = hd * L;
        let n_blocks = 8;
        let k: Vec<f16> = (0..n_blocks * nkv * bsz)
            .map(|i| f16::from_f32(((i * 7919 % 2003) as f32 / 1000.0) - 1.0))
            .collect();
        let v: Vec<f16> = (0..n_blocks * nkv * bsz)
            .map(|i| f16::from_f32(((i * 104_729 % 1999) as f32 / 999.0) - 1.0))
            .collect();
        let width = (nh + 2 * nkv) * hd;
        let table_a = [3u32, 0, 6, 1];
        let table_b = [2u32, 5, 7];
        let seqs = [
            Seq { past: 20, t: 21, table: &table_a, decode_from: 33 },
            Seq { past: 40, t: 1, table: &table_b, decode_from: 0 },
        ];
        let rows = 22;
        let qkv: Vec<f32> = (0..rows * width)
            .map(|i| f16::from_f32(((i * 31 % 97) as f32 / 48.0) - 1.0).to_f32())
            .collect();
        let b = Batch {
            qkv: &qkv,
            k: &k,
            v: &v,
            sh: Shape { n_heads: nh, n_kv_heads: nkv, head_dim: hd },
            seqs: &seqs,
            scale: 0.125,
            window,
        };
        let mut want = vec![0f32; rows * nh * hd];
        attend_with(Kind::Scalar, &b, &mut want);
        assert!(want.iter().all(|x| x.is_finite()) && want.iter().any(|&x| x != 0.0));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        #[allow(unused_mut)]
        let mut kinds = vec![kind()];
        #[cfg(target_arch = "x86_64")]
        if kind() == Kind::Avx512 {
            kinds.push(Kind::Avx2);
        }
        for k in kinds {
            let mut got = vec![0f32; rows * nh * hd];
            attend_with(k, &b, &mut got);
            assert_eq!(bits(&got), bits(&want), "{k:?} hd {hd}");
        }
    }
}
