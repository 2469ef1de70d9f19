//! A Merkle tree over one broadcast batch, so that one Ed25519 signature
//! covers many records and each record still verifies on its own.
//!
//! Why not a signature over "the records since the last heartbeat": the
//! global topic is compacted, and a rebuild reads whichever records
//! compaction kept. A record therefore carries its own proof (its index,
//! the batch size, the sibling hashes up to the root, and the root's
//! signature); a follower verifies the path (a few SHA-256) and the
//! signature once per root it has not seen (see `broadcast_auth`).
//!
//! Leaves and inner nodes are hashed with distinct prefixes (0 and 1), so
//! an inner node can never pass for a record. A level with an odd number of
//! nodes promotes its last node unchanged; the verifier knows when from the
//! batch size, which the signature covers.

use sha2::{Digest, Sha256};

pub type Hash = [u8; 32];

/// Hash of one record (its signed bytes).
pub fn leaf(bytes: &[u8]) -> Hash {
    let mut h = Sha256::new();
    h.update([0u8]);
    h.update(bytes);
    h.finalize().into()
}

fn node(left: &Hash, right: &Hash) -> Hash {
    let mut h = Sha256::new();
    h.update([1u8]);
    h.update(left);
    h.update(right);
    h.finalize().into()
}

/// The root of `leaves` and every leaf's path (sibling hashes, bottom up).
/// `leaves` must not be empty.
pub fn build(leaves: &[Hash]) -> (Hash, Vec<Vec<Hash>>) {
    assert!(!leaves.is_empty(), "a batch has at least one record");
    let mut paths = vec![Vec::new(); leaves.len()];
    // Which current-level node each leaf is under.
    let mut position: Vec<usize> = (0..leaves.len()).collect();
    let mut level = leaves.to_vec();
    while level.len() > 1 {
        for (leaf, pos) in position.iter_mut().enumerate() {
            let sibling = *pos ^ 1;
            if sibling < level.len() {
                paths[leaf].push(level[sibling]);
            }
            *pos /= 2;
        }
        level = level
            .chunks(2)
            .map(|pair| match pair {
                [l, r] => node(l, r),
                [only] => *only,
                _ => unreachable!("chunks(2)"),
            })
            .collect();
    }
    (level[0], paths)
}

/// The root that `leaf` at `index` of a batch of `count` leads to through
/// `path`; `None` if the path does not fit the position (wrong length).
/// Some other counts lead to the same root through the same path, which is
/// why the signature covers the count along with the root.
pub fn root_from_path(leaf: Hash, index: u32, count: u32, path: &[Hash]) -> Option<Hash> {
    if count == 0 || index >= count {
        return None;
    }
    let (mut index, mut width) = (index as usize, count as usize);
    let mut hash = leaf;
    let mut siblings = path.iter();
    while width > 1 {
        let sibling = index ^ 1;
        if sibling < width {
            let s = siblings.next()?;
            hash = if index % 2 == 0 {
                node(&hash, s)
            } else {
                node(s, &hash)
            };
        }
        index /= 2;
        width = width.div_ceil(2);
    }
    siblings.next().is_none().then_some(hash)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_leaf_proves_the_root_at_every_size() {
        for n in 1..=70u32 {
            let leaves: Vec<Hash> = (0..n).map(|i| leaf(&i.to_le_bytes())).collect();
            let (root, paths) = build(&leaves);
            for (i, (l, path)) in leaves.iter().zip(&paths).enumerate() {
                assert_eq!(
                    root_from_path(*l, i as u32, n, path),
                    Some(root),
                    "n={n} i={i}"
                );
                // Another position, another count or another leaf does not.
                if n > 1 {
                    let other = (i as u32 + 1) % n;
                    assert_ne!(root_from_path(*l, other, n, path), Some(root));
                    assert_ne!(
                        root_from_path(leaf(b"forged"), i as u32, n, path),
                        Some(root)
                    );
                }
            }
        }
    }

    #[test]
    fn malformed_positions_are_refused() {
        let l = leaf(b"x");
        assert_eq!(root_from_path(l, 0, 0, &[]), None);
        assert_eq!(root_from_path(l, 3, 3, &[]), None);
        assert_eq!(root_from_path(l, 0, 1, &[l]), None);
        assert_eq!(root_from_path(l, 0, 1, &[]), Some(l));
    }
}
