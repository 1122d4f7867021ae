"""An Apex-era DCGAN training script (the shape of Apex's examples/dcgan/main_amp.py),
unmodified: two models and two optimizers in one amp.initialize, three losses
each with its own loss scaler (num_losses=3, loss_id=0/1/2).
Tiny synthetic images stand in for the dataset.

usage: dcgan_amp.py [--opt_level O1] [--niter 3]
"""
import argparse
import json
import os
import sys

import torch
import torch.nn as nn
import torch.optim as optim

from apex import amp

parser = argparse.ArgumentParser()
parser.add_argument("--niter", type=int, default=3)
parser.add_argument("--lr", type=float, default=0.0002)
parser.add_argument("--beta1", type=float, default=0.5)
parser.add_argument("--opt_level", default="O1")
opt = parser.parse_args()
torch.manual_seed(999)
nz, ngf, ndf, nc = 8, 8, 8, 3


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        m.weight.data.normal_(0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        m.weight.data.normal_(1.0, 0.02)
        m.bias.data.fill_(0)


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.ConvTranspose2d(nz, ngf * 2, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
            nn.ConvTranspose2d(ngf * 2, nc, 4, 2, 1, bias=False), nn.Tanh(),
        )

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.main = nn.Sequential(
            nn.Conv2d(nc, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
            nn.Conv2d(ndf, 1, 4, 1, 0, bias=False),
        )

    def forward(self, input):
        return self.main(input).view(-1, 1).squeeze(1)


netG, netD = Generator(), Discriminator()
netG.apply(weights_init)
netD.apply(weights_init)
criterion = nn.BCEWithLogitsLoss()
fixed_noise = torch.randn(4, nz, 1, 1)
real_label, fake_label = 1, 0
optimizerD = optim.Adam(netD.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
optimizerG = optim.Adam(netG.parameters(), lr=opt.lr, betas=(opt.beta1, 0.999))
[netD, netG], [optimizerD, optimizerG] = amp.initialize(
    [netD, netG], [optimizerD, optimizerG], opt_level=opt.opt_level, num_losses=3)

g = torch.Generator().manual_seed(5)
dataloader = [torch.rand(4, nc, 8, 8, generator=g) * 2 - 1 for _ in range(2)]
errs = []
for epoch in range(opt.niter):
    for i, data in enumerate(dataloader):
        # (1) Update D: maximize log(D(x)) + log(1 - D(G(z)))
        netD.zero_grad()
        real_cpu = data
        batch_size = real_cpu.size(0)
        label = torch.full((batch_size,), real_label, dtype=real_cpu.dtype)
        output = netD(real_cpu)
        errD_real = criterion(output, label)
        with amp.scale_loss(errD_real, optimizerD, loss_id=0) as errD_real_scaled:
            errD_real_scaled.backward()
        noise = torch.randn(batch_size, nz, 1, 1)
        fake = netG(noise)
        label.fill_(fake_label)
        output = netD(fake.detach())
        errD_fake = criterion(output, label)
        with amp.scale_loss(errD_fake, optimizerD, loss_id=1) as errD_fake_scaled:
            errD_fake_scaled.backward()
        errD = errD_real + errD_fake
        optimizerD.step()
        # (2) Update G network: maximize log(D(G(z)))
        netG.zero_grad()
        label.fill_(real_label)
        output = netD(fake)
        errG = criterion(output, label)
        with amp.scale_loss(errG, optimizerG, loss_id=2) as errG_scaled:
            errG_scaled.backward()
        optimizerG.step()
        errs.append([errD.item(), errG.item()])

sys.stdout.flush()
os.write(sys.stdout.fileno(), ("RESULT " + json.dumps(dict(
    errs=errs, scales=[s.loss_scale() for s in amp._amp_state.loss_scalers],
    state=amp.state_dict(), fake_dtype=str(netG(fixed_noise).dtype),
)) + "\n").encode())
