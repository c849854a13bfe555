"""A matrix kept as the product of two factors, TransformerLens 3.9's `FactoredMatrix` (its names and meanings).

    ov = hm.OV                       # [n_layers, n_heads] of d_model x d_model, W_V @ W_O, never formed
    ov[3, 1].AB                      # one head's d_model x d_model matrix
    ov.eigenvalues                   # [n_layers, n_heads, d_head] complex: the nonzero eigenvalues of W_V @ W_O
    (hm.W_E @ ov[3, 1] @ hm.W_U)     # the full OV circuit, still factored (d_vocab x d_vocab through d_head)

A = [..., ldim, mdim], B = [..., mdim, rdim]; the leading dimensions broadcast. Everything is computed through the
inner dimension mdim: the eigenvalues of AB are those of BA (mdim x mdim) plus zeros; the singular values come from the
small matrix Ra @ Rb^T of the QR factorizations A = Qa Ra and B^T = Qb Rb (AB = Qa (Ra Rb^T) Qb^T).
"""

from __future__ import annotations

from functools import cached_property

import torch

from poslens.errors import UsageError


def _row_index(i):
    """An index into A's rows or B's columns that keeps the dimension (an int i -> the slice of i alone)."""
    if isinstance(i, int):
        return slice(i, i + 1 if i != -1 else None)
    return i


class FactoredMatrix:
    """The matrix A @ B ([..., ldim, rdim]) kept as its factors A [..., ldim, mdim] and B [..., mdim, rdim]."""

    def __init__(self, A: torch.Tensor, B: torch.Tensor) -> None:
        if A.dim() < 2 or B.dim() < 2:
            raise UsageError(f"FactoredMatrix: A and B must be matrices (or stacks of them), got shapes "
                             f"{tuple(A.shape)} and {tuple(B.shape)}")
        if A.shape[-1] != B.shape[-2]:
            raise UsageError(f"FactoredMatrix: A's last dimension ({A.shape[-1]}) must equal B's second-to-last "
                             f"({B.shape[-2]}); shapes {tuple(A.shape)} and {tuple(B.shape)}")
        try:
            lead = torch.broadcast_shapes(A.shape[:-2], B.shape[:-2])
        except RuntimeError:
            raise UsageError(f"FactoredMatrix: the leading dimensions of A {tuple(A.shape)} and B {tuple(B.shape)} do "
                             "not broadcast") from None
        self.ldim, self.mdim, self.rdim = A.shape[-2], A.shape[-1], B.shape[-1]
        self.shape = torch.Size((*lead, self.ldim, self.rdim))
        self.A = A.broadcast_to((*lead, self.ldim, self.mdim))
        self.B = B.broadcast_to((*lead, self.mdim, self.rdim))
        self.has_leading_dims = len(lead) > 0

    def __repr__(self) -> str:
        return f"FactoredMatrix: Shape({self.shape}), Hidden Dim({self.mdim})"

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.A, self.B

    @property
    def AB(self) -> torch.Tensor:
        """The product [..., ldim, rdim] (formed: as large as the matrix)."""
        return self.A @ self.B

    @property
    def BA(self) -> torch.Tensor:
        """The reverse product [..., mdim, mdim] (a square matrix only: ldim == rdim)."""
        if self.ldim != self.rdim:
            raise UsageError(f"FactoredMatrix.BA needs a square matrix, this one is {self.ldim} x {self.rdim}")
        return self.B @ self.A

    @property
    def T(self) -> FactoredMatrix:
        return FactoredMatrix(self.B.transpose(-2, -1), self.A.transpose(-2, -1))

    def __matmul__(self, other):
        """self @ other: a FactoredMatrix (other a matrix or a FactoredMatrix), or a vector (other a vector [rdim]).
        A matrix is absorbed into B when rdim > mdim (the inner dimension stays mdim), else the product AB becomes
        the left factor."""
        if isinstance(other, FactoredMatrix):
            return (self @ other.A) @ other.B
        if other.dim() < 2:
            return (self.A @ (self.B @ other[..., None]))[..., 0]
        if other.shape[-2] != self.rdim:
            raise UsageError(f"FactoredMatrix @ tensor: the tensor's rows ({other.shape[-2]}) must equal rdim "
                             f"({self.rdim})")
        if self.rdim > self.mdim:
            return FactoredMatrix(self.A, self.B @ other)
        return FactoredMatrix(self.AB, other)

    def __rmatmul__(self, other):
        """other @ self, as __matmul__ from the left (absorbed into A when ldim > mdim)."""
        if other.shape[-1] != self.ldim:
            raise UsageError(f"tensor @ FactoredMatrix: the tensor's columns ({other.shape[-1]}) must equal ldim "
                             f"({self.ldim})")
        if other.dim() < 2:
            return ((other[..., None, :] @ self.A) @ self.B)[..., 0, :]
        if self.ldim > self.mdim:
            return FactoredMatrix(other @ self.A, self.B)
        return FactoredMatrix(other, self.AB)

    def __mul__(self, scalar) -> FactoredMatrix:
        if isinstance(scalar, torch.Tensor) and scalar.numel() != 1:
            raise UsageError(f"FactoredMatrix * tensor: a scalar only, got shape {tuple(scalar.shape)} (use @ for a "
                             "matrix product)")
        return FactoredMatrix(self.A * scalar, self.B)

    __rmul__ = __mul__

    def __getitem__(self, idx) -> FactoredMatrix:
        """Index the leading dimensions; one index more selects rows (of A), two more rows and columns (of B). An
        integer row or column index keeps its dimension (length 1), so the result stays a matrix."""
        idx = idx if isinstance(idx, tuple) else (idx,)
        n, lead = sum(i is not None for i in idx), self.ndim - 2
        if n <= lead:
            return FactoredMatrix(self.A[idx], self.B[idx])
        if n == lead + 1:
            return FactoredMatrix(self.A[(*idx[:-1], _row_index(idx[-1]))], self.B[idx[:-1]])
        if n == lead + 2:
            rows, cols = _row_index(idx[-2]), _row_index(idx[-1])
            return FactoredMatrix(self.A[(*idx[:-2], rows)], self.B[(*idx[:-2], slice(None), cols)])
        raise UsageError(f"FactoredMatrix: index {idx} has {n} entries; this matrix of shape {tuple(self.shape)} takes "
                         f"at most {self.ndim}")

    def unsqueeze(self, k: int) -> FactoredMatrix:
        if k < 0:
            k += self.ndim + 1
        if not 0 <= k <= self.ndim - 2:
            raise UsageError(f"FactoredMatrix.unsqueeze: only a leading dimension (0-{self.ndim - 2}), got {k}")
        return FactoredMatrix(self.A.unsqueeze(k), self.B.unsqueeze(k))

    @cached_property
    def _svd(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qa, ra = torch.linalg.qr(self.A)  # A = Qa Ra
        qb, rb = torch.linalg.qr(self.B.transpose(-2, -1))  # B^T = Qb Rb
        um, s, vmh = torch.linalg.svd(ra @ rb.transpose(-2, -1), full_matrices=False)
        return qa @ um, s, qb @ vmh.transpose(-2, -1)

    def svd(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(U, S, V) with AB = U @ diag(S) @ V^T: U [..., ldim, k], S [..., k] descending, V [..., rdim, k], k =
        min(ldim, mdim, rdim) (each singular vector up to its sign)."""
        return self._svd

    @property
    def U(self) -> torch.Tensor:
        return self._svd[0]

    @property
    def S(self) -> torch.Tensor:
        return self._svd[1]

    @property
    def V(self) -> torch.Tensor:
        return self._svd[2]

    def norm(self) -> torch.Tensor:
        """The Frobenius norm of AB [...] (the root of the sum of its squared singular values), without an SVD:
        |AB|^2 = trace(A^T A B B^T), two mdim x mdim Gram matrices, in float64."""
        a, b = self.A.double(), self.B.double()
        gram = (a.transpose(-2, -1) @ a) * (b @ b.transpose(-2, -1))  # both symmetric: the trace of their product
        return gram.sum((-2, -1)).clamp_min(0).sqrt().to(self.A.dtype)

    @property
    def eigenvalues(self) -> torch.Tensor:
        """The eigenvalues of BA [..., mdim] (complex): AB's nonzero eigenvalues (AB v = k v gives BA (Bv) = k Bv);
        16-bit factors are computed in float32."""
        ba = self.BA
        return torch.linalg.eigvals(ba.float() if ba.dtype in (torch.float16, torch.bfloat16) else ba)

    def make_even(self) -> FactoredMatrix:
        """The same matrix as (U sqrt(S)) (sqrt(S) V^T): each factor carries half of every singular value."""
        root = self.S.sqrt()
        return FactoredMatrix(self.U * root[..., None, :], root[..., :, None] * self.V.transpose(-2, -1))

    def collapse_l(self) -> torch.Tensor:
        """diag(S) V^T [..., k, rdim]: the matrix without its left orthogonal factor U."""
        return self.S[..., :, None] * self.V.transpose(-2, -1)

    def collapse_r(self) -> torch.Tensor:
        """U diag(S) [..., ldim, k]: the matrix without its right orthogonal factor V^T."""
        return self.U * self.S[..., None, :]

    def get_corner(self, k: int = 3) -> torch.Tensor:
        """The leading k x k x ... corner of AB, formed from k rows of A and k columns of B only."""
        from poslens.utils import get_corner

        return get_corner(self.A[..., :k, :] @ self.B[..., :, :k], k)
