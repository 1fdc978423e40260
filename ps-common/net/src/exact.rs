//! The exact-sum mode's fixed point (`[train] exact_sum`, `ps_config::exact`): gradient terms
//! summed without rounding, in any order, with partial sums that travel and merge exactly.
//!
//! A value is an `i128` count of `2^-FRACTION_BITS`: an f32 term converts to it exactly when
//! `|x| >= 2^-FRACTION_BITS`, and with one deterministic rounding (to nearest, ties to even)
//! of what falls below the last bit otherwise; integer addition is associative and
//! commutative, so a sum is the same whatever the grouping. A partial sum travels as
//! [`LIMBS`] f32 values per parameter (interleaved: parameter `i` at `LIMBS * i ..`), each an
//! integer digit exactly representable in f32: two unsigned 24-bit digits, then the signed
//! rest; so the gRPC chunks, the data connection and the shared-memory boards carry it as they
//! carry any f32 tensor, three times as long. The sum is rounded to f32 once ([`round`]).

/// Bits below the binary point.
pub const FRACTION_BITS: u32 = 50;
/// f32 values per parameter of an encoded partial sum.
pub const LIMBS: usize = 3;
/// Bits of each of the two low digits.
const DIGIT_BITS: u32 = 24;
/// The largest biased f32 exponent of a term (`|x| < 2^22`): a partial sum must stay below
/// `2^(DIGIT_BITS * 3 - FRACTION_BITS)` = `2^22` in magnitude to travel in three digits.
const MAX_EXPONENT: u32 = 127 + 21;
/// The magnitude bound of a term and of a partial sum.
pub const BOUND: f32 = 4_194_304.0; // 2^22

/// Why a value cannot enter or leave the fixed point.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ExactError {
    /// A gradient term that is NaN or infinite.
    #[error("the gradient term holds {value} at index {index}: expected a finite value")]
    NotFinite {
        /// Parameter index.
        index: usize,
        /// The value.
        value: f32,
    },
    /// A term or a partial sum outside the range the digits carry.
    #[error(
        "the gradient holds {value} at index {index}: the exact sum carries magnitudes below 2^22 = 4194304 (each term and each worker's partial sum)"
    )]
    OutOfRange {
        /// Parameter index.
        index: usize,
        /// The value (of the partial sum, rounded).
        value: f32,
    },
    /// Received digits that no encoder writes.
    #[error(
        "exact partial sum: value {index} holds digit {value}: expected an integer in [0, 2^24) (or, every third, in [-2^24, 2^24))"
    )]
    BadDigit {
        /// Index in the encoded values.
        index: usize,
        /// The digit.
        value: f32,
    },
    /// Buffers of lengths that do not match.
    #[error("exact sum: {what} holds {got} values: expected {expected}")]
    Length {
        /// Which buffer.
        what: &'static str,
        /// Its length.
        got: usize,
        /// The length expected.
        expected: usize,
    },
}

/// `x` in units of `2^-FRACTION_BITS`, rounded to nearest (ties to even) below the last bit;
/// None when `|x| >= 2^22` or `x` is not finite.
///
/// Branch-free in f64 (the hot loop of a worker's terms): `y = x * 2^50` is exact; `hi`, `y`
/// rounded to a multiple of 2^32 by the add-and-subtract of `1.5 * 2^84` (exact for
/// `|y| < 2^83`), is an even integer, so `y - hi` is exact and rounding it to an integer (the
/// same trick at `1.5 * 2^52`, ties to even in the default rounding mode) rounds `y`.
#[inline]
pub fn fixed(x: f32) -> Option<i128> {
    if (x.to_bits() >> 23) & 0xff > MAX_EXPONENT {
        return None;
    }
    const SCALE: f64 = (1u64 << FRACTION_BITS) as f64;
    const HI: f64 = 1.5 * 19_342_813_113_834_066_795_298_816.0; // 1.5 * 2^84
    const LO: f64 = 1.5 * 4_503_599_627_370_496.0; // 1.5 * 2^52
    let y = f64::from(x) * SCALE;
    let hi = (y + HI) - HI;
    let lo = ((y - hi) + LO) - LO;
    // |hi| <= 2^72 as a multiple of 2^32: hi / 2^32 fits an i64 exactly, lo below 2^32
    let hi_units = (hi * (1.0 / 4_294_967_296.0)) as i64;
    Some((i128::from(hi_units) << 32) + i128::from(lo as i64))
}

/// [`fixed`] in integers: the mantissa shifted, rounded to nearest even below the last bit
/// (the definition the fast one is tested against).
#[cfg(test)]
fn fixed_by_shifts(x: f32) -> Option<i128> {
    let bits = x.to_bits();
    let exp = (bits >> 23) & 0xff;
    if exp > MAX_EXPONENT {
        return None;
    }
    let frac = i64::from(bits & 0x7f_ffff);
    let (mant, e) = if exp == 0 {
        (frac, -149)
    } else {
        (frac | 0x80_0000, exp as i32 - 150)
    };
    let shift = e + FRACTION_BITS as i32;
    let mag = if shift >= 0 {
        i128::from(mant) << shift
    } else {
        let k = (-shift) as u32;
        if k > 25 {
            0
        } else {
            let (q, r, half) = (mant >> k, mant & ((1 << k) - 1), 1 << (k - 1));
            i128::from(if r > half || (r == half && q & 1 == 1) {
                q + 1
            } else {
                q
            })
        }
    };
    Some(if bits >> 31 == 1 { -mag } else { mag })
}

/// Adds the f32 gradient `term` to the fixed-point sum `acc` (same length).
pub fn add_term(acc: &mut [i128], term: &[f32]) -> Result<(), ExactError> {
    check_len("the term", term.len(), acc.len())?;
    for (i, (a, &x)) in acc.iter_mut().zip(term).enumerate() {
        match fixed(x) {
            Some(v) => *a = a.wrapping_add(v),
            None if x.is_finite() => return Err(ExactError::OutOfRange { index: i, value: x }),
            None => return Err(ExactError::NotFinite { index: i, value: x }),
        }
    }
    Ok(())
}

/// Writes the partial sum `acc` into `out` ([`LIMBS`] values per parameter); an error when a
/// value is too large to travel.
pub fn encode(acc: &[i128], out: &mut [f32]) -> Result<(), ExactError> {
    check_len("the encoded partial sum", out.len(), LIMBS * acc.len())?;
    let mask = (1i128 << DIGIT_BITS) - 1;
    let limit = 1i128 << (3 * DIGIT_BITS - 1);
    for (i, (&v, o)) in acc.iter().zip(out.chunks_exact_mut(LIMBS)).enumerate() {
        if v >= limit || v < -limit {
            return Err(ExactError::OutOfRange {
                index: i,
                value: round_one(v),
            });
        }
        // each digit fits an i32 (|digit| <= 2^24): the hardware conversion, exact
        o[0] = (v & mask) as i32 as f32;
        o[1] = ((v >> DIGIT_BITS) & mask) as i32 as f32;
        o[2] = (v >> (2 * DIGIT_BITS)) as i32 as f32;
    }
    Ok(())
}

/// Adds the encoded partial sum `limbs` ([`encode`]) to `acc`; an error (nothing said about
/// `acc`, which the caller discards) for digits no encoder writes.
pub fn add_encoded(acc: &mut [i128], limbs: &[f32]) -> Result<(), ExactError> {
    check_len("the encoded partial sum", limbs.len(), LIMBS * acc.len())?;
    const TOP: i32 = 1 << DIGIT_BITS;
    for (i, (a, d)) in acc.iter_mut().zip(limbs.chunks_exact(LIMBS)).enumerate() {
        // an integer digit converts to i32 and back unchanged (NaN and the out-of-range
        // saturate or truncate, and fail the range test or the round trip)
        let (d0, d1, d2) = (d[0] as i32, d[1] as i32, d[2] as i32);
        let whole = d0 as f32 == d[0] && d1 as f32 == d[1] && d2 as f32 == d[2];
        if !whole
            || !(0..TOP).contains(&d0)
            || !(0..TOP).contains(&d1)
            || !(-TOP..TOP).contains(&d2)
        {
            let k = [d0, d1, d2]
                .iter()
                .zip(d)
                .enumerate()
                .position(|(k, (&di, &df))| {
                    di as f32 != df || !(if k == 2 { -TOP..TOP } else { 0..TOP }).contains(&di)
                })
                .unwrap_or(0);
            return Err(ExactError::BadDigit {
                index: LIMBS * i + k,
                value: d[k],
            });
        }
        let v =
            (i128::from(d2) << (2 * DIGIT_BITS)) + (i128::from(d1) << DIGIT_BITS) + i128::from(d0);
        *a = a.wrapping_add(v);
    }
    Ok(())
}

/// The f32 nearest to a fixed-point value (ties to even): the one rounding of the mode.
#[inline]
pub fn round_one(v: i128) -> f32 {
    // exact scaling: |v as f32| >= 1 unless 0, and 2^-50 keeps it a normal f32; i64 to f32
    // is the hardware's correctly rounded conversion, as i128's (in software) is
    let f = match i64::try_from(v) {
        Ok(small) => small as f32,
        Err(_) => v as f32,
    };
    f * f32::from_bits((127 - FRACTION_BITS) << 23)
}

/// Rounds the sum `acc` into `out` (same length).
pub fn round(acc: &[i128], out: &mut [f32]) -> Result<(), ExactError> {
    check_len("the rounded sum", out.len(), acc.len())?;
    out.iter_mut()
        .zip(acc)
        .for_each(|(o, &v)| *o = round_one(v));
    Ok(())
}

/// The coefficient of a mean over `terms` gradient terms (of a mean loss each): the mean over
/// their samples, as the shard and the single-process reference apply it.
pub fn mean_coefficient(terms: usize) -> f32 {
    1.0 / terms.max(1) as f32
}

fn check_len(what: &'static str, got: usize, expected: usize) -> Result<(), ExactError> {
    if got == expected {
        Ok(())
    } else {
        Err(ExactError::Length {
            what,
            got,
            expected,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic stream of f32 of mixed magnitudes and signs.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let mant = ((s >> 40) as f32) / (1u64 << 24) as f32;
                let exp = ((s >> 8) % 60) as i32 - 50;
                let sign = if s & 1 == 1 { -1.0 } else { 1.0 };
                sign * mant * 2f32.powi(exp)
            })
            .collect()
    }

    #[test]
    fn conversion_is_exact_above_the_last_bit_and_rounds_ties_to_even_below() {
        for &x in &[
            1.0f32,
            -1.0,
            0.1,
            -3.75e-7,
            4_194_303.5,
            2f32.powi(-50),
            0.0,
        ] {
            assert_eq!(round_one(fixed(x).unwrap()), x, "{x}");
        }
        assert_eq!(
            fixed(2f32.powi(-51)),
            Some(0),
            "half the last bit, even: down"
        );
        assert_eq!(
            fixed(3.0 * 2f32.powi(-51)),
            Some(2),
            "one and a half: up to even"
        );
        assert_eq!(fixed(-3.0 * 2f32.powi(-51)), Some(-2));
        assert_eq!(fixed(f32::MIN_POSITIVE / 2.0), Some(0), "subnormal");
        assert_eq!(fixed(BOUND), None);
        assert_eq!(fixed(f32::NAN), None);
        assert_eq!(fixed(f32::NEG_INFINITY), None);
    }

    #[test]
    fn the_fast_conversion_is_the_integer_one() {
        let mut xs = values(100_000, 3);
        xs.extend(values(20_000, 5).iter().map(|v| v * 4096.0));
        // ties at and around the last bit, the bounds, subnormals, zeros
        for k in 0..64 {
            let t = (2 * k + 1) as f32 * 2f32.powi(-51);
            xs.extend([t, -t, t * 2.0, (k as f32 + 0.5) * 2f32.powi(-50)]);
        }
        xs.extend([
            0.0,
            -0.0,
            f32::MIN_POSITIVE,
            1e-45,
            BOUND * 0.999_999_9,
            -BOUND * 0.999_999_9,
        ]);
        xs.extend([BOUND, f32::MAX, f32::NAN, f32::INFINITY]);
        for x in xs {
            assert_eq!(fixed(x), fixed_by_shifts(x), "{x:e} ({:#x})", x.to_bits());
        }
    }

    #[test]
    fn any_grouping_and_order_gives_the_same_bits() {
        let terms: Vec<Vec<f32>> = (0..12).map(|k| values(257, k)).collect();
        let sum_of = |order: &[usize], groups: usize| {
            // partial sums of `groups` contiguous parts of `order`, encoded, merged
            let mut total = vec![0i128; 257];
            let parts = order.chunks(order.len().div_ceil(groups));
            for part in parts.rev() {
                let mut acc = vec![0i128; 257];
                for &k in part {
                    add_term(&mut acc, &terms[k]).unwrap();
                }
                let mut wire = vec![0f32; LIMBS * 257];
                encode(&acc, &mut wire).unwrap();
                add_encoded(&mut total, &wire).unwrap();
            }
            let mut out = vec![0f32; 257];
            round(&total, &mut out).unwrap();
            out.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        };
        let forward: Vec<usize> = (0..12).collect();
        let shuffled = [7, 2, 11, 0, 5, 9, 1, 10, 3, 8, 6, 4];
        let one = sum_of(&forward, 1);
        for groups in [2, 3, 4, 5, 12] {
            assert_eq!(sum_of(&forward, groups), one, "{groups} groups");
            assert_eq!(sum_of(&shuffled, groups), one, "{groups} groups, shuffled");
        }
        // and it is the correctly rounded sum: f64 adds these (exponents within 60 bits of
        // each other, 12 terms) without loss only sometimes, so compare with a few exact cases
        let mut acc = vec![0i128; 1];
        for x in [1.0f32, 2f32.powi(-40), -1.0] {
            add_term(&mut acc, &[x]).unwrap();
        }
        let mut out = [0f32];
        round(&acc, &mut out).unwrap();
        assert_eq!(out[0], 2f32.powi(-40), "no cancellation error");
    }

    #[test]
    fn out_of_range_and_bad_digits_are_errors() {
        let mut acc = vec![0i128; 2];
        let e = add_term(&mut acc, &[0.0, f32::NAN]).unwrap_err();
        assert!(
            matches!(e, ExactError::NotFinite { index: 1, value } if value.is_nan()),
            "{e}"
        );
        let e = add_term(&mut acc, &[5e6, 0.0]).unwrap_err();
        assert!(matches!(e, ExactError::OutOfRange { index: 0, .. }), "{e}");
        // two terms in range whose sum is not
        let mut acc = vec![0i128; 1];
        add_term(&mut acc, &[3e6]).unwrap();
        add_term(&mut acc, &[3e6]).unwrap();
        let mut wire = vec![0f32; LIMBS];
        let e = encode(&acc, &mut wire).unwrap_err();
        assert_eq!(
            e.to_string(),
            "the gradient holds 6000000 at index 0: the exact sum carries magnitudes below 2^22 = 4194304 (each term and each worker's partial sum)"
        );
        let e = add_encoded(&mut acc, &[0.5, 0.0, 0.0]).unwrap_err();
        assert_eq!(
            e,
            ExactError::BadDigit {
                index: 0,
                value: 0.5
            }
        );
        let e = add_encoded(&mut acc, &[0.0, 0.0, 2e7]).unwrap_err();
        assert_eq!(
            e,
            ExactError::BadDigit {
                index: 2,
                value: 2e7
            }
        );
        let e = add_encoded(&mut acc, &[0.0, 0.0]).unwrap_err();
        assert!(
            matches!(
                e,
                ExactError::Length {
                    got: 2,
                    expected: 3,
                    ..
                }
            ),
            "{e}"
        );
    }
}
