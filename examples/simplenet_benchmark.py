"""The Paddle AMP tutorial's benchmark, in PyTorch with amp_patch.

Trains the tutorial's SimpleNet (three Linear layers, ReLU after the first
two) with MSE loss and SGD, first in FP32 ("default"), then with one line of
amp_patch at O1 and at O2, and prints each run's last loss and total time as
the tutorial does. Mixed precision is FP16 on CUDA and BF16 on the CPU.

    python examples/simplenet_benchmark.py              # small: seconds on a CPU
    python examples/simplenet_benchmark.py --full       # the tutorial's sizes
"""
import argparse
import time

import torch
import torch.nn as nn

import amp_patch

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--size", type=int, default=512, help="input and output size (tutorial: 4096)")
parser.add_argument("--batch-size", type=int, default=64, help="a multiple of 8 (tutorial: 512)")
parser.add_argument("--batches", type=int, default=8, help="batches per epoch (tutorial: 50)")
parser.add_argument("--epochs", type=int, default=2, help="(tutorial: 5)")
parser.add_argument("--full", action="store_true", help="the tutorial's sizes")
args = parser.parse_args()
if args.full:
    args.size, args.batch_size, args.batches, args.epochs = 4096, 512, 50, 5

device = "cuda" if torch.cuda.is_available() else "cpu"
start_time = None


def start_timer():
    global start_time
    if device == "cuda":
        torch.cuda.synchronize()
    start_time = time.perf_counter()


def end_timer_and_print(msg):
    if device == "cuda":
        torch.cuda.synchronize()
    print("\n" + msg)
    print("total time = {:.3f} sec".format(time.perf_counter() - start_time))


class SimpleNet(nn.Module):
    def __init__(self, input_size, output_size):
        super().__init__()
        self.linear1 = nn.Linear(input_size, output_size)
        self.relu1 = nn.ReLU()
        self.linear2 = nn.Linear(input_size, output_size)
        self.relu2 = nn.ReLU()
        self.linear3 = nn.Linear(input_size, output_size)

    def forward(self, x):
        x = self.linear1(x)
        x = self.relu1(x)
        x = self.linear2(x)
        x = self.relu2(x)
        x = self.linear3(x)
        return x


torch.manual_seed(0)
train_data = [torch.randn(args.batch_size, args.size, device=device) for _ in range(args.batches)]
labels = [torch.randn(args.batch_size, args.size, device=device) for _ in range(args.batches)]
mse = nn.MSELoss()


def train(opt_level=None):
    torch.manual_seed(1)
    model = SimpleNet(args.size, args.size).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0001)
    if opt_level is not None:
        model, optimizer = amp_patch.initialize(model, optimizer, opt_level=opt_level)  # the one line
    try:
        start_timer()
        for epoch in range(args.epochs):
            for data, label in zip(train_data, labels):
                output = model(data)
                loss = mse(output, label)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        print(f"loss = {loss.item():.6f}, model output dtype = {output.dtype}")
    finally:
        amp_patch.deinitialize()


train()
end_timer_and_print("Default time:")
train("O1")
end_timer_and_print("AMP time in O1 mode:")
try:
    train("O2")
    end_timer_and_print("AMP time in O2 mode:")
except amp_patch.ConfigError as e:
    print(f"\nO2 is not available in this build: {e}")
