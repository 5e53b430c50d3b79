import pytest
import torch
from torch import nn

from sparktrain.sparse.rows import rows_of, sparse_parameters


class Towers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.users = nn.Embedding(10, 4, sparse=True)
        self.items = nn.EmbeddingBag(12, 4, sparse=True, mode="sum")
        self.dense_table = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 1)


def test_only_sparse_embedding_weights_are_named() -> None:
    names = [n for n, _ in sparse_parameters(Towers())]
    assert names == ["users.weight", "items.weight"]


def test_frozen_tables_are_left_out() -> None:
    m = Towers()
    m.users.weight.requires_grad_(False)
    assert [n for n, _ in sparse_parameters(m)] == ["items.weight"]


def test_rows_sum_duplicate_ids_in_ascending_order() -> None:
    emb = nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([7, 2, 7, 2, 2])).sum().backward()
    assert emb.weight.grad is not None
    idx, rows = rows_of(emb.weight.grad)
    assert idx.tolist() == [2, 7]
    assert idx.dtype == torch.int64
    torch.testing.assert_close(rows, torch.tensor([[3.0] * 3, [2.0] * 3]))


def test_a_dense_gradient_is_refused() -> None:
    with pytest.raises(TypeError, match="sparse=True"):
        rows_of(torch.zeros(3, 2))
