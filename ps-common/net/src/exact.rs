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
//! carry any f32 tensor, three times as long. The sum is rounded to f32 once ([`round_one`]).
//!
//! The sums are kept in i64 lanes without carrying between them ([`TermSum`]: a term's value
//! split once into `hi * 2^32 + lo`; [`sum_encoded`]: one lane per digit), which every term
//! adds to in a loop of plain integer additions (vectorised with AVX2 where the CPU has it);
//! the lanes are joined once, when the sum is encoded or rounded. [`MAX_TERMS`] bounds the
//! additions so that no lane overflows.

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
    /// More additions than the lanes hold without a carry.
    #[error("exact sum: more than {limit} additions of terms or partial sums in one sum")]
    TooManyTerms {
        /// [`MAX_TERMS`].
        limit: usize,
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
/// same trick at `1.5 * 2^52`, ties to even in the default rounding mode) rounds `y`; both
/// integers are read from the bits of an f64 (no conversion instruction, so the loops over
/// them vectorise).
#[inline]
pub fn fixed(x: f32) -> Option<i128> {
    if !in_range(x) {
        return None;
    }
    let (hi, lo) = split(x);
    Some((i128::from(hi) << 32) + i128::from(lo))
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

/// Additions a [`TermSum`] or one [`sum_encoded`] takes: below it no i64 lane can overflow
/// (a term adds at most 2^40 to a high lane, a digit at most 2^24).
pub const MAX_TERMS: usize = 1 << 22;

/// `1.5 * 2^52`: added to an f64 below 2^51 in magnitude, it rounds it to an integer (ties
/// to even), which its bits then hold in the low mantissa bits.
const MAGIC: f64 = 1.5 * 4_503_599_627_370_496.0;
/// `1.5 * 2^84`: the same rounding to a multiple of 2^32.
const MAGIC_HI: f64 = 1.5 * 19_342_813_113_834_066_795_298_816.0;
/// `2^FRACTION_BITS`.
const SCALE: f64 = (1u64 << FRACTION_BITS) as f64;

/// The integer in an f64 `MAGIC + t` (`|t| < 2^51`): `t`.
#[inline(always)]
fn unmagic(f: f64) -> i64 {
    (f.to_bits() as i64).wrapping_sub(MAGIC.to_bits() as i64)
}

/// [`fixed`] as `(hi, lo)`, the value `hi * 2^32 + lo` with `|lo| <= 2^31` and `|hi| <=
/// 2^40`, in f64 and integer lanes only (no conversion instruction: it vectorises); garbage,
/// without a panic, for a term out of range ([`in_range`]).
#[inline(always)]
fn split(x: f32) -> (i64, i64) {
    let y = f64::from(x) * SCALE;
    let hi = (y + MAGIC_HI) - MAGIC_HI;
    let lo = unmagic((y - hi) + MAGIC);
    let hi = unmagic(hi * (1.0 / 4_294_967_296.0) + MAGIC);
    (hi, lo)
}

/// Whether the fixed point carries `x` (finite, `|x| < 2^22`).
#[inline(always)]
fn in_range(x: f32) -> bool {
    (x.to_bits() >> 23) & 0xff <= MAX_EXPONENT
}

/// The error of a term out of range.
fn term_error(index: usize, x: f32) -> ExactError {
    if x.is_finite() {
        ExactError::OutOfRange { index, value: x }
    } else {
        ExactError::NotFinite { index, value: x }
    }
}

/// A worker's exact partial sum of f32 gradient terms, in two i64 lanes per value (the value
/// is `hi * 2^32 + lo` units): a term adds to both without carrying, and the lanes are joined
/// once, when the sum is encoded ([`TermSum::encode`]) or rounded ([`TermSum::round`]).
#[derive(Debug, Clone, Default)]
pub struct TermSum {
    hi: Vec<i64>,
    lo: Vec<i64>,
    adds: usize,
}

impl TermSum {
    /// Zero, for `len` values.
    pub fn reset(&mut self, len: usize) {
        for lane in [&mut self.hi, &mut self.lo] {
            lane.clear();
            lane.resize(len, 0);
        }
        self.adds = 0;
    }

    /// The number of values.
    pub fn len(&self) -> usize {
        self.hi.len()
    }

    /// Whether it holds no values.
    pub fn is_empty(&self) -> bool {
        self.hi.is_empty()
    }

    /// Adds the f32 gradient `term` (the sum's length).
    pub fn add_term(&mut self, term: &[f32]) -> Result<(), ExactError> {
        check_len("the term", term.len(), self.len())?;
        self.add_term_at(0, term)
    }

    /// Adds `term` to the values from `start` on (a part of a term: each part counts as an
    /// addition towards [`MAX_TERMS`]); on an error the sum is left partly added.
    pub fn add_term_at(&mut self, start: usize, term: &[f32]) -> Result<(), ExactError> {
        let end = start.saturating_add(term.len());
        if end > self.len() {
            return Err(ExactError::Length {
                what: "the term's range",
                got: end,
                expected: self.len(),
            });
        }
        if self.adds >= MAX_TERMS {
            return Err(ExactError::TooManyTerms { limit: MAX_TERMS });
        }
        self.adds += 1;
        let (hi, lo) = (&mut self.hi[start..end], &mut self.lo[start..end]);
        if add_terms(hi, lo, term) {
            let (i, &x) = term
                .iter()
                .enumerate()
                .find(|(_, x)| !in_range(**x))
                .unwrap_or((0, &0.0));
            return Err(term_error(start + i, x));
        }
        Ok(())
    }

    /// Writes the values `range` into `out` ([`LIMBS`] digits each); an error when a value is
    /// too large to travel.
    pub fn encode(&self, range: std::ops::Range<usize>, out: &mut [f32]) -> Result<(), ExactError> {
        if range.start > range.end || range.end > self.len() {
            return Err(ExactError::Length {
                what: "the encoded range",
                got: range.end,
                expected: self.len(),
            });
        }
        check_len("the encoded partial sum", out.len(), LIMBS * range.len())?;
        let (hi, lo) = (&self.hi[range.clone()], &self.lo[range.clone()]);
        if encode_lanes(hi, lo, out) {
            let i = (0..hi.len())
                .find(|&i| !(-LIMIT_HI..LIMIT_HI).contains(&join_hi(hi[i], lo[i]).0))
                .unwrap_or(0);
            return Err(ExactError::OutOfRange {
                index: range.start + i,
                value: round_one(self.value(range.start + i)),
            });
        }
        Ok(())
    }

    /// Rounds the sum into `out` (the sum's length): the value the shards round from its
    /// encoding (the single-process reference's step).
    pub fn round(&self, out: &mut [f32]) -> Result<(), ExactError> {
        check_len("the rounded sum", out.len(), self.len())?;
        for (i, o) in out.iter_mut().enumerate() {
            *o = round_one(self.value(i));
        }
        Ok(())
    }

    /// Value `i` in units of `2^-FRACTION_BITS`.
    pub fn value(&self, i: usize) -> i128 {
        (i128::from(self.hi[i]) << 32) + i128::from(self.lo[i])
    }
}

/// `hi * 2^32 + lo` as `(h, l)` with `0 <= l < 2^32`: `lo`'s carry moved into `hi`.
#[inline(always)]
fn join_hi(hi: i64, lo: i64) -> (i64, i64) {
    (hi.wrapping_add(lo >> 32), lo & 0xffff_ffff)
}

/// The bound of a joined high lane: a value travels when `-2^40 <= h < 2^40` (it is then in
/// `[-2^72, 2^72)` units, magnitudes below 2^22, what the top digit carries).
const LIMIT_HI: i64 = 1 << (3 * DIGIT_BITS - 32);

/// Adds the terms `x` into the lanes; true when a term is out of range (the lanes then hold
/// garbage there).
#[inline(always)]
fn add_terms_portable(hi: &mut [i64], lo: &mut [i64], x: &[f32]) -> bool {
    let mut bad = false;
    for ((h, l), &x) in hi.iter_mut().zip(lo.iter_mut()).zip(x) {
        bad |= !in_range(x);
        let (dh, dl) = split(x);
        *h = h.wrapping_add(dh);
        *l = l.wrapping_add(dl);
    }
    bad
}

/// Encodes the lanes into `out` (three digits each); true when a value is out of range.
#[inline(always)]
fn encode_portable(hi: &[i64], lo: &[i64], out: &mut [f32]) -> bool {
    let mask = (1i64 << DIGIT_BITS) - 1;
    let mut bad = false;
    for ((&h, &l), o) in hi.iter().zip(lo).zip(out.chunks_exact_mut(LIMBS)) {
        let (h, l) = join_hi(h, l);
        bad |= !(-LIMIT_HI..LIMIT_HI).contains(&h);
        // v >> 24, v = h * 2^32 + l: below 2^47 in magnitude when h is in range
        let t = (h << 8).wrapping_add(l >> DIGIT_BITS);
        // each digit fits an i32 (|digit| <= 2^24): the conversion is exact
        o[0] = (l & mask) as i32 as f32;
        o[1] = (t & mask) as i32 as f32;
        o[2] = (t >> DIGIT_BITS) as i32 as f32;
    }
    bad
}

/// The top digit's bound: digits lie in `[0, 2^24)`, the top one in `[-2^24, 2^24)`.
const TOP: i32 = 1 << DIGIT_BITS;

/// Adds the digits `d` into the lanes `acc` (one per digit); true when one is not a digit an
/// encoder writes (the lanes then hold garbage). In f64 lanes (no saturating conversion, so
/// it vectorises): a digit is integral when rounding it to an integer leaves it unchanged
/// (NaN never is), and in range by two comparisons (which the infinities fail).
#[inline(always)]
fn add_digits_portable(acc: &mut [i64], d: &[f32]) -> bool {
    // 8 values (24 digits) a pass, with the bounds of their positions
    const N: usize = 8 * LIMBS;
    let lower: [f64; N] = std::array::from_fn(|k| {
        if k % LIMBS == LIMBS - 1 {
            -f64::from(TOP)
        } else {
            0.0
        }
    });
    let top = f64::from(TOP);
    // a flag per position, reduced once at the end
    let mut bad = [false; N];
    let mut add = |a: &mut [i64], x: &[f32], lower: &[f64]| {
        for (((a, &x), &low), bad) in a.iter_mut().zip(x).zip(lower).zip(bad.iter_mut()) {
            let x = f64::from(x);
            let r = x + MAGIC;
            *bad |= ((r - MAGIC) != x) | !((x >= low) & (x < top));
            *a = a.wrapping_add(unmagic(r));
        }
    };
    let mut chunks = acc.chunks_exact_mut(N);
    let mut xs = d.chunks_exact(N);
    for (a, x) in (&mut chunks).zip(&mut xs) {
        add(a, x, &lower);
    }
    add(chunks.into_remainder(), xs.remainder(), &lower);
    bad.contains(&true)
}

/// Rounds the lanes `acc` (three per value, digits' sums) into `out`.
#[inline(always)]
fn round_digits(acc: &[i64], out: &mut [f32]) {
    let mask = (1i64 << DIGIT_BITS) - 1;
    for (a, o) in acc.chunks_exact(LIMBS).zip(out.iter_mut()) {
        // the carries up: v = u * 2^48 + d1 * 2^24 + d0, 0 <= d0, d1 < 2^24
        let t = a[1] + (a[0] >> DIGIT_BITS);
        let u = a[2] + (t >> DIGIT_BITS);
        let low = ((t & mask) << DIGIT_BITS) | (a[0] & mask);
        *o = if (-(1 << 14)..1 << 14).contains(&u) {
            round_one(i128::from((u << (2 * DIGIT_BITS)) | low))
        } else {
            round_one((i128::from(u) << (2 * DIGIT_BITS)) | i128::from(low))
        };
    }
}

macro_rules! with_avx2 {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty = $portable:ident, $avx2:ident;) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2")]
        fn $avx2($($arg: $ty),*) -> $ret {
            $portable($($arg),*)
        }

        $(#[$doc])*
        fn $name($($arg: $ty),*) -> $ret {
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2, checked just above.
                return unsafe { $avx2($($arg),*) };
            }
            $portable($($arg),*)
        }
    };
}

with_avx2! {
    /// [`add_terms_portable`], with AVX2 where the CPU has it (the same integers).
    fn add_terms(hi: &mut [i64], lo: &mut [i64], x: &[f32]) -> bool = add_terms_portable, add_terms_avx2;
}
with_avx2! {
    /// [`encode_portable`], with AVX2 where the CPU has it (the same digits).
    fn encode_lanes(hi: &[i64], lo: &[i64], out: &mut [f32]) -> bool = encode_portable, encode_avx2;
}
with_avx2! {
    /// [`add_digits_portable`], with AVX2 where the CPU has it (the same integers).
    fn add_digits(acc: &mut [i64], d: &[f32]) -> bool = add_digits_portable, add_digits_avx2;
}

/// The first digit of `d` that no encoder writes, as an error naming its index in the whole
/// encoded sum (`d` starts at digit `base`).
fn digit_error(d: &[f32], base: usize) -> ExactError {
    let k = d
        .iter()
        .enumerate()
        .position(|(k, &x)| {
            let di = x as i32;
            let low = if k % LIMBS == LIMBS - 1 { -TOP } else { 0 };
            di as f32 != x || !(low..TOP).contains(&di)
        })
        .unwrap_or(0);
    ExactError::BadDigit {
        index: base + k,
        value: d.get(k).copied().unwrap_or(0.0),
    }
}

/// Values a block of [`sum_encoded`] sums at a time (its lanes stay in the core's cache).
const BLOCK: usize = 1024;

/// The sum of the encoded partial sums `parts` ([`TermSum::encode`], [`LIMBS`] digits per
/// value), rounded once into `out`: value `i` of `out` is the sum of values `at + i` of the
/// parts. An error names the part and the digit (its index in the part) that no encoder
/// writes, or the part too short.
pub fn sum_encoded(
    parts: &[&[f32]],
    at: usize,
    out: &mut [f32],
) -> Result<(), (usize, ExactError)> {
    let need = LIMBS * (at + out.len());
    if let Some((i, p)) = parts.iter().enumerate().find(|(_, p)| p.len() < need) {
        let e = ExactError::Length {
            what: "the encoded partial sum",
            got: p.len(),
            expected: need,
        };
        return Err((i, e));
    }
    if parts.len() > MAX_TERMS {
        return Err((0, ExactError::TooManyTerms { limit: MAX_TERMS }));
    }
    let mut lanes = vec![0i64; LIMBS * BLOCK.min(out.len())];
    for (b, o) in out.chunks_mut(BLOCK).enumerate() {
        let first = LIMBS * (at + b * BLOCK);
        let acc = &mut lanes[..LIMBS * o.len()];
        acc.fill(0);
        for (i, p) in parts.iter().enumerate() {
            let d = &p[first..first + LIMBS * o.len()];
            if add_digits(acc, d) {
                return Err((i, digit_error(d, first)));
            }
        }
        round_digits(acc, o);
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

    /// Encoded partial sums of `groups` contiguous parts of `order`, merged on a "shard"
    /// split at `at` (two calls of [`sum_encoded`]), as bits.
    fn merged(terms: &[Vec<f32>], order: &[usize], groups: usize, at: usize) -> Vec<u32> {
        let n = terms[0].len();
        let wires: Vec<Vec<f32>> = order
            .chunks(order.len().div_ceil(groups))
            .rev()
            .map(|part| {
                let mut acc = TermSum::default();
                acc.reset(n);
                for &k in part {
                    acc.add_term(&terms[k]).unwrap();
                }
                let mut wire = vec![0f32; LIMBS * n];
                acc.encode(0..n, &mut wire).unwrap();
                wire
            })
            .collect();
        let parts: Vec<&[f32]> = wires.iter().map(|w| &w[..]).collect();
        let mut out = vec![0f32; n];
        let (head, tail) = out.split_at_mut(at);
        sum_encoded(&parts, 0, head).unwrap();
        sum_encoded(&parts, at, tail).unwrap();
        out.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn any_grouping_and_order_gives_the_same_bits() {
        // 2 blocks and a part of one, so that the block loop and its remainder both run
        let n = 2 * BLOCK + 257;
        let terms: Vec<Vec<f32>> = (0..12).map(|k| values(n, k)).collect();
        let forward: Vec<usize> = (0..12).collect();
        let shuffled = [7, 2, 11, 0, 5, 9, 1, 10, 3, 8, 6, 4];
        let one = merged(&terms, &forward, 1, 0);
        for groups in [2, 3, 4, 5, 12] {
            for at in [0, 7, BLOCK + 1, n] {
                assert_eq!(merged(&terms, &forward, groups, at), one, "{groups} groups");
                assert_eq!(
                    merged(&terms, &shuffled, groups, at),
                    one,
                    "{groups}, shuffled"
                );
            }
        }
        // and it is the correctly rounded sum of the terms' fixed-point values, summed in
        // i128 (the definition), which the worker's own rounding also gives
        let mut acc = TermSum::default();
        acc.reset(n);
        let mut want = vec![0i128; n];
        for t in &terms {
            acc.add_term(t).unwrap();
            want.iter_mut()
                .zip(t)
                .for_each(|(w, &x)| *w += fixed_by_shifts(x).unwrap());
        }
        let want: Vec<u32> = want.iter().map(|&v| round_one(v).to_bits()).collect();
        assert_eq!(one, want);
        let mut out = vec![0f32; n];
        acc.round(&mut out).unwrap();
        assert_eq!(out.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), want);
        let mut acc = TermSum::default();
        acc.reset(1);
        for x in [1.0f32, 2f32.powi(-40), -1.0] {
            acc.add_term(&[x]).unwrap();
        }
        let mut out = [0f32];
        acc.round(&mut out).unwrap();
        assert_eq!(out[0], 2f32.powi(-40), "no cancellation error");
    }

    #[test]
    fn carries_across_the_lanes_at_the_range_ends_keep_every_bit() {
        // values near 2^22 whose lanes carry into each other, summed to just below the
        // travel bound and past it, with negatives that borrow through every digit
        let big = BOUND * 0.999_999_9;
        let tiny = 2f32.powi(-50);
        let terms = [
            vec![big, -big, tiny, -tiny, 0.75, -3.0 * tiny],
            vec![-tiny, big, -big, -tiny, 2f32.powi(-30), 5.0 * tiny],
            vec![tiny, -tiny, tiny, -big, -0.75, -tiny],
        ];
        let n = terms[0].len();
        let mut want = vec![0i128; n];
        let mut acc = TermSum::default();
        acc.reset(n);
        for t in &terms {
            acc.add_term(t).unwrap();
            want.iter_mut()
                .zip(t)
                .for_each(|(w, &x)| *w += fixed_by_shifts(x).unwrap());
        }
        for (i, &w) in want.iter().enumerate() {
            assert_eq!(acc.value(i), w, "value {i}");
        }
        let mut wire = vec![0f32; LIMBS * n];
        acc.encode(0..n, &mut wire).unwrap();
        let mut out = vec![0f32; n];
        sum_encoded(&[&wire, &wire], 0, &mut out).unwrap();
        for (i, (&o, &w)) in out.iter().zip(&want).enumerate() {
            assert_eq!(o.to_bits(), round_one(2 * w).to_bits(), "value {i}");
        }
    }

    #[test]
    fn the_avx2_loops_are_the_portable_ones() {
        let n = 3 * 64 + 5;
        let xs = values(n, 9);
        let (mut h1, mut l1) = (vec![3i64; n], vec![-5i64; n]);
        let (mut h2, mut l2) = (h1.clone(), l1.clone());
        assert!(!add_terms_portable(&mut h1, &mut l1, &xs));
        assert!(!add_terms(&mut h2, &mut l2, &xs));
        assert_eq!((&h1, &l1), (&h2, &l2));
        let (mut w1, mut w2) = (vec![0f32; LIMBS * n], vec![0f32; LIMBS * n]);
        assert!(!encode_portable(&h1, &l1, &mut w1));
        assert!(!encode_lanes(&h2, &l2, &mut w2));
        assert_eq!(w1, w2);
        let (mut a1, mut a2) = (vec![7i64; LIMBS * n], vec![7i64; LIMBS * n]);
        assert!(!add_digits_portable(&mut a1, &w1));
        assert!(!add_digits(&mut a2, &w2));
        assert_eq!(a1, a2);
    }

    #[test]
    fn out_of_range_and_bad_digits_are_errors() {
        let mut acc = TermSum::default();
        acc.reset(2);
        let e = acc.add_term(&[0.0, f32::NAN]).unwrap_err();
        assert!(
            matches!(e, ExactError::NotFinite { index: 1, value } if value.is_nan()),
            "{e}"
        );
        let e = acc.add_term_at(1, &[5e6]).unwrap_err();
        assert!(matches!(e, ExactError::OutOfRange { index: 1, .. }), "{e}");
        // two terms in range whose sum is not
        let mut acc = TermSum::default();
        acc.reset(2);
        acc.add_term(&[1.0, 3e6]).unwrap();
        acc.add_term(&[1.0, 3e6]).unwrap();
        let mut wire = vec![0f32; 2 * LIMBS];
        let e = acc.encode(0..2, &mut wire).unwrap_err();
        assert_eq!(
            e.to_string(),
            "the gradient holds 6000000 at index 1: the exact sum carries magnitudes below 2^22 = 4194304 (each term and each worker's partial sum)"
        );
        let mut out = [0f32];
        let good = [0.0f32, 0.0, 0.0];
        let two = [0.0f32, 0.0, 0.0, 1.0, 2.0, -3.0];
        let e = sum_encoded(&[&two, &[0.0, 0.0, 0.0, 0.5, 0.0, 0.0]], 1, &mut out).unwrap_err();
        assert_eq!(
            e,
            (
                1,
                ExactError::BadDigit {
                    index: 3,
                    value: 0.5
                }
            )
        );
        let e = sum_encoded(&[&[0.0, 0.0, 2e7]], 0, &mut out).unwrap_err();
        assert_eq!(
            e,
            (
                0,
                ExactError::BadDigit {
                    index: 2,
                    value: 2e7
                }
            )
        );
        let e = sum_encoded(&[&[-1.0, 0.0, 0.0]], 0, &mut out).unwrap_err();
        assert_eq!(
            e,
            (
                0,
                ExactError::BadDigit {
                    index: 0,
                    value: -1.0
                }
            )
        );
        let e = sum_encoded(&[&[0.0, 0.0, f32::NAN]], 0, &mut out).unwrap_err();
        assert!(
            matches!(e, (0, ExactError::BadDigit { index: 2, .. })),
            "{e:?}"
        );
        let e = sum_encoded(&[&good, &[0.0, 0.0]], 0, &mut out).unwrap_err();
        assert!(
            matches!(
                e,
                (
                    1,
                    ExactError::Length {
                        got: 2,
                        expected: 3,
                        ..
                    }
                )
            ),
            "{e:?}"
        );
        let mut acc = TermSum::default();
        acc.reset(1);
        acc.adds = MAX_TERMS;
        assert_eq!(
            acc.add_term(&[1.0]).unwrap_err(),
            ExactError::TooManyTerms { limit: MAX_TERMS }
        );
    }
}
