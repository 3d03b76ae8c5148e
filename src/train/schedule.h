// Learning-rate schedules (step counts from 0): linear warm-up to lr over warmup_steps, then
//   cosine:   min_lr + (lr − min_lr)·(1 + cos(π·p))/2, p = (step − warmup) / (steps − warmup)
//   wsd:      lr until the last decay_fraction of the steps, then linear to min_lr (warmup-stable-decay)
//   constant: lr
// with min_lr = min_lr_ratio · lr.
#pragma once

#include "train/config.h"

namespace tessera::train {

double learning_rate(const TrainConfig& c, int64_t step);

}  // namespace tessera::train
