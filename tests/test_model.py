import torch

from tokenloom.model import ModelConfig, Transformer


def _model():
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=300, dim=64, n_layers=2, n_heads=2))


def test_documents_in_a_packed_row_do_not_see_each_other():
    model = _model().eval()
    ids = torch.randint(0, 300, (1, 24))
    docs = torch.tensor([[0] * 10 + [1] * 14])
    pos = torch.cat([torch.arange(10), torch.arange(14)])[None]
    out = model(ids, pos, docs)
    changed = ids.clone()
    changed[0, :10] = torch.randint(0, 300, (10,))  # rewrite document 0 only
    out2 = model(changed, pos, docs)
    torch.testing.assert_close(out[0, 10:], out2[0, 10:])  # document 1 unaffected
    assert not torch.allclose(out[0, :10], out2[0, :10])


def test_causal_future_tokens_do_not_leak():
    model = _model().eval()
    ids = torch.randint(0, 300, (2, 16))
    pos, docs = torch.arange(16).expand(2, 16), torch.zeros(2, 16, dtype=torch.long)
    out = model(ids, pos, docs)
    changed = ids.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 300
    torch.testing.assert_close(model(changed, pos, docs)[:, :8], out[:, :8])


def test_loss_decreases_when_overfitting_one_batch():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 300, (2, 32))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "position_ids": torch.arange(31).expand(2, 31),
             "doc_ids": torch.zeros(2, 31, dtype=torch.long)}
    first = model.loss(batch).item()
    for _ in range(30):
        loss = model.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first
