"""A few optimizer steps of a tiny model under `accelerate launch`; prints what accelerate set up."""
import json

import torch
from accelerate import Accelerator

accelerator = Accelerator()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
x = torch.randn(64, 8)
data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))  # learnable: the loss must fall
loader = torch.utils.data.DataLoader(data, batch_size=8)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
losses = []
for x, y in [batch for _ in range(3) for batch in loader]:
    loss = torch.nn.functional.mse_loss(model(x), y)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
stage = model.zero_optimization_stage() if hasattr(model, "zero_optimization_stage") else None
accelerator.print(json.dumps({"engine": type(model).__name__, "zero_stage": stage,
                              "processes": accelerator.num_processes, "losses": losses}))
