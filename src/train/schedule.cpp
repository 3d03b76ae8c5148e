// Learning-rate schedules.
#include "train/schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace tessera::train {

double learning_rate(const TrainConfig& c, int64_t step) {
    if (step < c.warmup_steps) return c.lr * double(step + 1) / double(c.warmup_steps);
    const double min_lr = c.min_lr_ratio * c.lr;
    if (c.schedule == "constant") return c.lr;
    if (c.schedule == "wsd") {
        const double decay_start = double(c.steps) * (1.0 - c.decay_fraction);
        if (double(step) < decay_start) return c.lr;
        const double p = std::min(1.0, (double(step) - decay_start) / std::max(1.0, double(c.steps) - decay_start));
        return c.lr + (min_lr - c.lr) * p;
    }
    const double span = std::max<double>(1.0, double(c.steps - c.warmup_steps));
    const double p = std::min(1.0, double(step - c.warmup_steps) / span);
    return min_lr + (c.lr - min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * p));
}

}  // namespace tessera::train
