//! The device check's own rules, without a device.

use super::*;
use crate::sampling::TokenLogprob;

fn lp(chosen: u32, top: &[(u32, f32)]) -> Logprobs {
    let t = |(token, logprob)| TokenLogprob { token, logprob };
    let logprob = top.iter().find(|x| x.0 == chosen).map_or(-9.0, |x| x.1);
    Logprobs { chosen: t((chosen, logprob)), top: top.iter().copied().map(t).collect() }
}

/// A stream that leaves the CPU's at a token still has that token's
/// alternatives compared (same context), and nothing after it.
#[test]
fn logprobs_are_compared_up_to_the_first_token_that_differs() {
    let want = Stream {
        ids: vec![1, 2, 3],
        logprobs: vec![
            lp(1, &[(1, -0.5), (7, -1.0)]),
            lp(2, &[(2, -0.25), (8, -2.0)]),
            lp(3, &[(3, -0.125), (9, -3.0)]),
        ],
    };
    let a = LogprobAgreement::of(&[want.ids.clone()], &[want.logprobs.clone()], &want);
    assert_eq!((a.tokens, a.top_ids_equal, a.max_abs_delta, a.bit_equal), (3, 3, 0.0, true));
    // Drawn 8 at the second token: the alternatives there differ by
    // 0.5 in one logprob; the third token (another context) is left out.
    let got = vec![
        lp(1, &[(1, -0.5), (7, -1.0)]),
        lp(8, &[(2, -0.25), (8, -1.5)]),
        lp(4, &[(4, -0.1), (5, -9.0)]),
    ];
    let a = LogprobAgreement::of(&[vec![1, 8, 4]], &[got], &want);
    assert_eq!((a.tokens, a.top_ids_equal, a.max_abs_delta, a.bit_equal), (2, 2, 0.5, false));
    // Left at the first token: that one is still compared.
    let got = vec![lp(7, &[(7, -0.5), (1, -1.0)])];
    let a = LogprobAgreement::of(&[vec![7]], &[got], &want);
    assert_eq!((a.tokens, a.top_ids_equal, a.bit_equal), (1, 0, false));
}
