use proptest::prelude::*;

use super::*;

fn toks(start: u32, n: usize) -> Vec<u32> {
    (start..start + n as u32).collect()
}

#[test]
fn prefix_blocks_are_reused_within_a_tenant_only() {
    let mut m = BlockManager::new(32);
    let (a, b) = (tenant_salt("a"), tenant_salt("b"));
    let p = toks(0, 70); // 4 full blocks + 6
    assert_eq!(m.admit(1, a, &p).unwrap(), 0);
    m.commit(1, 70).unwrap();
    assert_eq!(m.cached_blocks(), 4);
    // Same prefix, different tail: 4 blocks (64 tokens) reused.
    let mut q = toks(0, 64);
    q.extend([999, 998, 997]);
    assert_eq!(m.admit(2, a, &q).unwrap(), 64);
    assert_eq!(m.block_table(2).unwrap()[..4], m.block_table(1).unwrap()[..4]);
    // Another tenant never shares.
    assert_eq!(m.admit(3, b, &q).unwrap(), 0);
    // The last prompt token is always recomputed: a 64-token prompt reuses 3 blocks.
    assert_eq!(m.admit(4, a, &toks(0, 64)).unwrap(), 48);
    m.check_invariants().unwrap();
    for s in 1..=4 {
        m.free(s).unwrap();
    }
    m.check_invariants().unwrap();
    assert_eq!(m.used_blocks(), 0);
    // Still cached after release, reused by a later request.
    assert_eq!(m.admit(5, a, &p).unwrap(), 64);
    m.check_invariants().unwrap();
}

#[test]
fn divergent_prefix_stops_reuse() {
    let mut m = BlockManager::new(16);
    let s = tenant_salt("t");
    m.admit(1, s, &toks(0, 48)).unwrap();
    m.commit(1, 48).unwrap();
    let mut q = toks(0, 48);
    q[20] = 7777; // second block differs
    assert_eq!(m.admit(2, s, &q).unwrap(), 16, "only the first block matches");
    m.check_invariants().unwrap();
}

#[test]
fn lru_evicts_unreferenced_cached_blocks() {
    let mut m = BlockManager::new(4);
    let s = tenant_salt("t");
    m.admit(1, s, &toks(0, 33)).unwrap(); // 3 blocks
    m.commit(1, 33).unwrap();
    m.free(1).unwrap();
    assert_eq!(m.available_blocks(), 4);
    assert_eq!(m.cached_blocks(), 2);
    // Needs all 4 blocks: both cached ones are evicted.
    assert_eq!(m.admit(2, s, &toks(100, 64)).unwrap(), 0);
    assert_eq!(m.cached_blocks(), 0);
    assert!(matches!(m.admit(3, s, &[1]), Err(PagedError::OutOfBlocks { .. })));
    m.check_invariants().unwrap();
}

#[test]
fn fork_shares_and_append_copies_on_write() {
    let mut m = BlockManager::new(8);
    let s = tenant_salt("t");
    m.admit(1, s, &toks(0, 20)).unwrap();
    m.commit(1, 20).unwrap();
    m.fork(1, 2).unwrap();
    assert_eq!(m.used_blocks(), 2);
    let last = m.block_table(1).unwrap()[1];
    // Appending to the shared partial block copies its 4 filled positions.
    let cp = m.append(2, 5).unwrap().unwrap();
    assert_eq!((cp.src, cp.tokens), (last, 4));
    assert_ne!(m.block_table(2).unwrap()[1], last);
    assert_eq!(m.block_table(2).unwrap()[0], m.block_table(1).unwrap()[0]);
    // The parent now owns its block alone: no copy.
    assert_eq!(m.append(1, 6).unwrap(), None);
    m.check_invariants().unwrap();
    m.free(1).unwrap();
    m.free(2).unwrap();
    assert_eq!(m.used_blocks(), 0);
    m.check_invariants().unwrap();
}

#[test]
fn out_of_blocks_changes_nothing() {
    let mut m = BlockManager::new(2);
    let s = tenant_salt("t");
    m.admit(1, s, &toks(0, 32)).unwrap();
    let before = format!("{m:?}");
    assert!(matches!(m.append(1, 1), Err(PagedError::OutOfBlocks { .. })));
    assert!(m.admit(2, s, &[1]).is_err());
    assert_eq!(format!("{m:?}"), before);
    assert!(matches!(m.admit(1, s, &[1]), Err(PagedError::DuplicateSeq(1))));
    assert!(matches!(m.free(9), Err(PagedError::UnknownSeq(9))));
}

#[derive(Debug, Clone)]
enum Op {
    Admit { tenant: u8, base: u8, len: usize },
    Append { seq: usize, tok: u32 },
    Commit { seq: usize },
    Fork { seq: usize },
    Free { seq: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..2, 0u8..3, 1usize..70).prop_map(|(tenant, base, len)| Op::Admit {
            tenant,
            base,
            len
        }),
        (0usize..8, 0u32..4).prop_map(|(seq, tok)| Op::Append { seq, tok }),
        (0usize..8).prop_map(|seq| Op::Commit { seq }),
        (0usize..8).prop_map(|seq| Op::Fork { seq }),
        (0usize..8).prop_map(|seq| Op::Free { seq }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Random admit / append / commit / fork / cancel / finish sequences:
    /// refcounts always match the block tables, no block leaks, free +
    /// cached + used = total, and everything is released at the end.
    #[test]
    fn block_manager_invariants(ops in proptest::collection::vec(op(), 1..120), total in 4usize..40) {
        let mut m = BlockManager::new(total);
        let mut live: Vec<SeqId> = Vec::new();
        let mut next: SeqId = 0;
        for op in ops {
            match op {
                Op::Admit { tenant, base, len } => {
                    // Few bases, so prompts often share prefixes.
                    let prompt: Vec<u32> = (0..len as u32).map(|i| i / 3 + base as u32).collect();
                    next += 1;
                    let avail = m.available_blocks();
                    match m.admit(next, tenant_salt(&tenant.to_string()), &prompt) {
                        Ok(cached) => {
                            prop_assert!(cached < len && cached % BLOCK_SIZE == 0);
                            live.push(next);
                        }
                        Err(PagedError::OutOfBlocks { need, .. }) => prop_assert!(need > 0 && need <= blocks_for(len) && avail < blocks_for(len)),
                        Err(e) => prop_assert!(false, "{e}"),
                    }
                }
                Op::Append { seq, tok } if !live.is_empty() => {
                    let id = live[seq % live.len()];
                    let len = m.seq_len(id).unwrap_or(0);
                    match m.append(id, tok) {
                        Ok(_) => prop_assert_eq!(m.seq_len(id), Some(len + 1)),
                        Err(e) => prop_assert!(matches!(e, PagedError::OutOfBlocks { .. }), "{}", e),
                    }
                }
                Op::Commit { seq } if !live.is_empty() => {
                    let id = live[seq % live.len()];
                    let len = m.seq_len(id).unwrap_or(0);
                    m.commit(id, len).map_err(|e| TestCaseError::fail(e.to_string()))?;
                }
                Op::Fork { seq } if !live.is_empty() => {
                    let id = live[seq % live.len()];
                    next += 1;
                    m.fork(id, next).map_err(|e| TestCaseError::fail(e.to_string()))?;
                    live.push(next);
                }
                Op::Free { seq } if !live.is_empty() => {
                    let id = live.remove(seq % live.len());
                    m.free(id).map_err(|e| TestCaseError::fail(e.to_string()))?;
                }
                _ => {}
            }
            m.check_invariants().map_err(TestCaseError::fail)?;
            prop_assert_eq!(m.num_seqs(), live.len());
        }
        for id in live {
            m.free(id).map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        m.check_invariants().map_err(TestCaseError::fail)?;
        prop_assert_eq!(m.used_blocks(), 0);
        prop_assert_eq!(m.available_blocks(), total);
    }
}

/// K/V computed in decode order (generated tokens) are never reused for
/// the same tokens as a prompt (prefill order), but are for a sequence
/// resumed with the same prompt/generated split.
#[test]
fn cache_keys_hold_the_prefill_decode_split() {
    let mut m = BlockManager::new(16);
    let s = tenant_salt("t");
    m.admit(1, s, &toks(0, 20)).unwrap();
    m.commit(1, 20).unwrap();
    for t in 20..40 {
        m.append(1, t).unwrap();
    }
    m.commit(1, 40).unwrap();
    assert_eq!(m.cached_blocks(), 2);
    // The same 40 tokens as a prompt: only the all-prompt first block matches.
    assert_eq!(m.admit(2, s, &toks(0, 40)).unwrap(), 16);
    // A resumed sequence (prompt of 20, then 20 generated): both blocks.
    assert_eq!(m.admit_at(3, s, &toks(0, 40), 20).unwrap(), 32);
    // Another split point: the second block differs.
    assert_eq!(m.admit_at(4, s, &toks(0, 40), 24).unwrap(), 16);
    m.check_invariants().unwrap();
    assert_eq!(prompt_decode_from(1), 0, "a one-token prompt is a decode-order row");
    assert_eq!(prompt_decode_from(7), 7);
}
