"""Hadamard matrices for the sizes real models have, and a fast transform by them.

Rotation (QuaRot, Ashkboos et al. 2024; SpinQuant, Liu et al. 2024) multiplies activations by an orthogonal
matrix so that one massive channel is spread over all of them. A Hadamard matrix H (entries +-1,
H H^T = n I) scaled by 1/sqrt(n) is the usual choice: no parameters, and a fast O(n log n) product for the
power-of-two part. Real widths are seldom powers of two (SmolLM2's 576 = 36 * 16, its FFN 1536 = 12 * 128,
Gemma-3-270M's 640 = 20 * 32), so a size n is written n = K * 2^m and

    H_n = H_K (x) H_{2^m}          (Kronecker product; index i = a * 2^m + b)

with H_{2^m} from Sylvester's doubling and H_K from Paley's constructions over the finite field GF(q)
(R. E. A. C. Paley, "On orthogonal matrices", J. Math. Phys. 12, 1933):

- Paley I, q = K - 1 a prime power with q = 3 (mod 4): H = I + [[0, j^T], [-j, Q]];
- Paley II, q = K / 2 - 1 a prime power with q = 1 (mod 4): C = [[0, j^T], [j, Q]], and each entry of C
  becomes a 2 x 2 block: 0 -> [[1, -1], [-1, -1]], +-1 -> +-[[1, 1], [1, -1]];

where Q[x, y] = chi(x - y) is the Jacobsthal matrix of the quadratic character chi of GF(q). These cover
QuaRot's K in {12, 20, 28, 36, 40, 44, 52, 60, 108, 140} (40 = 2 * 20) and every other K they reach; a size
they do not reach (e.g. K = 156, 172 need Williamson matrices, not built here) has no Hadamard matrix here:
:func:`hadamard_factors` says so and the caller chooses a block-diagonal Hadamard or a random orthogonal
matrix. Every matrix is checked (entries +-1, H H^T = n I in integers) once, when it is built.
"""

from __future__ import annotations

import functools
import math

import torch

from diffquant.errors import DiffquantError

__all__ = [
    "fast_hadamard",
    "hadamard",
    "hadamard_factors",
    "has_hadamard",
    "sylvester",
]


# ------------------------------------------------------------------------------------- finite fields


def _prime_power(q: int) -> tuple[int, int] | None:
    """(p, k) with q = p^k for a prime p, or None."""
    if q < 2:
        return None
    p = next(d for d in range(2, q + 1) if q % d == 0)  # smallest factor: prime
    k, rest = 0, q
    while rest % p == 0:
        rest //= p
        k += 1
    return (p, k) if rest == 1 else None


def _poly_mulmod(a: list[int], b: list[int], mod: list[int], p: int) -> list[int]:
    """a * b modulo the monic polynomial ``mod`` over GF(p); coefficients lowest degree first."""
    k = len(mod) - 1
    out = [0] * (2 * k)
    for i, x in enumerate(a):
        if x:
            for j, y in enumerate(b):
                out[i + j] = (out[i + j] + x * y) % p
    for d in range(len(out) - 1, k - 1, -1):  # reduce: x^d = -(mod[:k]) * x^(d-k)
        c = out[d]
        if c:
            out[d] = 0
            for i in range(k):
                out[d - k + i] = (out[d - k + i] - c * mod[i]) % p
    return out[:k]


def _irreducible(p: int, k: int) -> list[int]:
    """A monic polynomial of degree ``k`` irreducible over GF(p): the first with no root-free factorisation,
    found by checking that x^(p^i) != x mod f for i < k with gcd conditions replaced by a brute-force search
    for factors (k is small: q <= a few hundred)."""
    if k == 1:
        return [0, 1]
    for code in range(p**k):
        low = [(code // p**i) % p for i in range(k)]
        f = [*low, 1]
        if not _has_factor(f, p):
            return f
    raise AssertionError(f"no irreducible polynomial of degree {k} over GF({p})")  # cannot happen


def _has_factor(f: list[int], p: int) -> bool:
    """Whether the monic ``f`` has a monic factor of degree 1 .. deg(f) // 2 (trial division)."""
    k = len(f) - 1
    for d in range(1, k // 2 + 1):
        for code in range(p**d):
            g = [*((code // p**i) % p for i in range(d)), 1]
            if _poly_rem(f, g, p) == [0] * d:
                return True
    return False


def _poly_rem(f: list[int], g: list[int], p: int) -> list[int]:
    """f mod the monic g over GF(p)."""
    r = list(f)
    d = len(g) - 1
    for top in range(len(r) - 1, d - 1, -1):
        c = r[top]
        if c:
            for i in range(d + 1):
                r[top - d + i] = (r[top - d + i] - c * g[i]) % p
    return r[:d]


def _quadratic_character(q: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """GF(q) as base-p digit vectors (element e <-> its digits, lowest first: a polynomial over GF(p)
    modulo an irreducible one) and chi(e) for each e: 0 for zero, +1 for a nonzero square, -1 otherwise.
    Returns (digits (q, k) int64, chi (q,) int64, p). Subtraction is digit-wise mod p."""
    pk = _prime_power(q)
    assert pk is not None
    p, k = pk
    powers = torch.tensor([p**i for i in range(k)], dtype=torch.int64)
    digits = (torch.arange(q, dtype=torch.int64)[:, None] // powers) % p
    if k == 1:
        squares = set(((torch.arange(1, q, dtype=torch.int64) ** 2) % q).tolist())
    else:
        mod = _irreducible(p, k)
        squares = set()
        for e in range(1, q):
            x = digits[e].tolist()
            squares.add(sum(c * p**i for i, c in enumerate(_poly_mulmod(x, x, mod, p))))
    chi = torch.tensor([0] + [1 if e in squares else -1 for e in range(1, q)], dtype=torch.int64)
    return digits, chi, p


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[x, y] = chi(x - y) over GF(q) (int64)."""
    digits, chi, p = _quadratic_character(q)
    powers = torch.tensor([p**i for i in range(digits.shape[1])], dtype=torch.int64)
    difference = (digits[:, None, :] - digits[None, :, :]) % p
    return chi[(difference * powers).sum(-1)]


# ------------------------------------------------------------------------------------------- matrices


def sylvester(n: int) -> torch.Tensor:
    """H_{2^m} by Sylvester's doubling, H_{2k} = [[H, H], [H, -H]] (int64); n must be a power of two."""
    if n < 1 or n & (n - 1):
        raise DiffquantError(f"Sylvester Hadamard size {n}: not a power of two")
    h = torch.ones(1, 1, dtype=torch.int64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _paley1(q: int) -> torch.Tensor:
    """Order q + 1 for a prime power q = 3 (mod 4)."""
    n = q + 1
    s = torch.zeros(n, n, dtype=torch.int64)
    s[0, 1:] = 1
    s[1:, 0] = -1
    s[1:, 1:] = _jacobsthal(q)
    return torch.eye(n, dtype=torch.int64) + s


def _paley2(q: int) -> torch.Tensor:
    """Order 2 (q + 1) for a prime power q = 1 (mod 4)."""
    c = torch.zeros(q + 1, q + 1, dtype=torch.int64)
    c[0, 1:] = 1
    c[1:, 0] = 1
    c[1:, 1:] = _jacobsthal(q)
    one = torch.tensor([[1, 1], [1, -1]], dtype=torch.int64)
    zero = torch.tensor([[1, -1], [-1, -1]], dtype=torch.int64)
    return torch.kron(c, one) + torch.kron((c == 0).to(torch.int64), zero)


MAX_BASE = 512  # largest K built by Paley here; real widths need K <= 172 (156 and 172 through 312 and 344)


def _base_construction(k: int) -> str | None:
    """How H_K is built here ('sylvester', 'paley1 q=..', 'paley2 q=..'), or None."""
    if k in (1, 2):
        return "sylvester"
    if k % 4 or k > MAX_BASE:
        return None
    q = k - 1
    if _prime_power(q) and q % 4 == 3:
        return f"paley1 q={q}"
    q = k // 2 - 1
    if _prime_power(q) and q % 4 == 1:
        return f"paley2 q={q}"
    return None


def hadamard_factors(n: int) -> tuple[int, int] | None:
    """(K, 2^m) with n = K * 2^m and H_K constructible here, the largest power of two first (the fast part),
    or None when no Hadamard matrix of size ``n`` is built here."""
    if n < 1:
        return None
    power = n & -n  # the largest power of two dividing n
    while power >= 1:
        k = n // power
        if _base_construction(k) is not None:
            return k, power
        power //= 2
    return None


def has_hadamard(n: int) -> bool:
    return hadamard_factors(n) is not None


@functools.lru_cache(maxsize=64)
def _base(k: int) -> torch.Tensor:
    """H_K (int64), checked: entries +-1 and H H^T = K I exactly."""
    how = _base_construction(k)
    if how is None:
        raise DiffquantError(f"no Hadamard matrix of order {k} is built here")
    if how == "sylvester":
        h = sylvester(k)
    else:
        q = int(how.split("q=")[1])
        h = _paley1(q) if how.startswith("paley1") else _paley2(q)
    gram = h.double() @ h.double().T  # integers below 2^53: exact in float64 (an int64 matmul is slow)
    if not (h.abs() == 1).all() or not torch.equal(gram, k * torch.eye(k, dtype=torch.float64)):
        raise AssertionError(f"Hadamard construction {how} for order {k} is wrong")  # a bug, not input
    return h


def hadamard(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The dense H_n = H_K (x) H_{2^m} (entries +-1, not normalised); a one-line error when none is built."""
    factors = hadamard_factors(n)
    if factors is None:
        raise DiffquantError(
            f"size {n}: no Hadamard matrix is built for it (sizes K * 2^m with K from Paley's constructions); "
            "ask for a block-diagonal Hadamard (rotate.hadamard_block: 64) or a random orthogonal matrix"
        )
    k, power = factors
    return torch.kron(_base(k), sylvester(power)).to(dtype)


def construction(n: int) -> str:
    """A short description of how H_n is built, for reports: e.g. ``paley2 q=17 (36) x sylvester (16)``."""
    factors = hadamard_factors(n)
    if factors is None:
        return "none"
    k, power = factors
    if k == 1:
        return f"sylvester ({power})"
    if power == 1:
        return f"{_base_construction(k)} ({k})"
    return f"{_base_construction(k)} ({k}) x sylvester ({power})"


def _fwht(x: torch.Tensor) -> torch.Tensor:
    """x @ H_{2^m} along the last dim (unnormalised), by m butterfly passes: O(n log n)."""
    n = x.shape[-1]
    shape = x.shape
    h = 1
    y = x.reshape(-1, n)
    while h < n:
        y = y.reshape(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return y.reshape(shape)


def fast_hadamard(x: torch.Tensor, normalise: bool = True) -> torch.Tensor:
    """x @ H_n^T along the last dim (H_n symmetric or not), / sqrt(n) when ``normalise``: the power-of-two
    factor by the fast transform, the K factor by a K x K matmul. Equals ``x @ hadamard(n).T`` (tests)."""
    n = x.shape[-1]
    factors = hadamard_factors(n)
    if factors is None:
        raise DiffquantError(f"size {n}: no Hadamard matrix is built for it")
    k, power = factors
    y = _fwht(x.reshape(*x.shape[:-1], k, power))  # the Sylvester factor is symmetric
    if k > 1:
        base = _base(k).to(dtype=x.dtype, device=x.device)
        y = torch.matmul(base, y)  # (..., K, 2^m): row a of the result = sum_a' H_K[a, a'] y[a']
    y = y.reshape(x.shape)
    return y / math.sqrt(n) if normalise else y
