// Registration of op families into the registry (called once by op_registry()).
#pragma once

#include "ops/registry.h"

namespace tessera::ops {

void register_dense_ops(OpRegistry& r);
void register_kda_ops(OpRegistry& r);
void register_moe_ops(OpRegistry& r);
void register_dsa_ops(OpRegistry& r);

}  // namespace tessera::ops
