"""A small CNN on real data: scikit-learn's bundled handwritten digits.

``sklearn.datasets.load_digits`` ships 1797 8x8 images of the digits 0-9 with
scikit-learn itself (no download). The same CNN is trained twice from the same
initial weights, in FP32 and with amp_patch (BF16 on the CPU, FP16 on CUDA),
and both are scored on the same held-out quarter of the images.

    pip install -e '.[examples]'         # scikit-learn, in a checkout of amp_patch
    python examples/digits_cnn.py --epochs 8
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits

import amp_patch

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=8)
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--opt-level", default="O1")
args = parser.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"

digits = load_digits()
images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # N x 1 x 8 x 8, in [0, 1]
targets = torch.tensor(digits.target)
order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))
n_test = len(images) // 4
test_idx, train_idx = order[:n_test], order[n_test:]
x_train, y_train = images[train_idx].to(device), targets[train_idx].to(device)
x_test, y_test = images[test_idx].to(device), targets[test_idx].to(device)


class DigitsCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def train_and_score(opt_level=None):
    torch.manual_seed(0)
    model = DigitsCNN().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    if opt_level is not None:
        model, optimizer = amp_patch.initialize(model, optimizer, opt_level=opt_level)
    try:
        shuffle = torch.Generator().manual_seed(1)
        for epoch in range(args.epochs):
            model.train()
            perm = torch.randperm(len(x_train), generator=shuffle).to(device)
            for i in range(0, len(perm), args.batch_size):
                idx = perm[i:i + args.batch_size]
                optimizer.zero_grad()
                logits = model(x_train[idx])
                loss = F.cross_entropy(logits, y_train[idx])
                loss.backward()
                optimizer.step()
        model.eval()
        with torch.no_grad():
            logits = model(x_test)
        accuracy = (logits.argmax(1) == y_test).float().mean().item()
        return accuracy, loss.item(), str(logits.dtype).replace("torch.", "")
    finally:
        amp_patch.deinitialize()


print(f"digits: {len(x_train)} training and {len(x_test)} test images, {args.epochs} epochs, {device}")
fp32_acc, fp32_loss, fp32_dtype = train_and_score()
print(f"FP32: test accuracy {fp32_acc:.4f}, last loss {fp32_loss:.4f}, logits in {fp32_dtype}")
amp_acc, amp_loss, amp_dtype = train_and_score(args.opt_level)
print(f"{args.opt_level}: test accuracy {amp_acc:.4f}, last loss {amp_loss:.4f}, logits in {amp_dtype}")
print(f"accuracy difference (AMP - FP32): {amp_acc - fp32_acc:+.4f}")
