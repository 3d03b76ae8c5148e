// train.recompute (docs/train.md): which blocks re-run their forward before their backward instead of keeping their
// activations through the step. Every block kind recomputed shares one saved set over its blocks: the last block of
// the kind (the first the backward meets) still holds its own activations there and is not re-run, every other block
// of the kind re-runs its forward from its input (the residual stream keeps every block's input). Blocks of kinds not
// recomputed keep a saved set each. Recompute changes no result: every forward is deterministic.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "core/json.h"

namespace tessera::model {

struct Recompute {
    bool all = false;                // every kind
    std::vector<std::string> kinds;  // else these block kinds (Model::block_kinds names), sorted, no repeats

    // the block kinds a config may name
    static const std::vector<std::string>& known_kinds();
    static Recompute every() { return {.all = true}; }
    static Recompute of(std::vector<std::string> kinds);  // sorted, repeats dropped; every known kind: every()
    // train.recompute's value: true, false, a block kind or a list of them; one-line error naming `where` otherwise
    static Recompute from_json(const Json& v, const std::string& where);

    bool covers(std::string_view kind) const;
    // one-line error when it names a kind none of a model's blocks (Model::block_kinds) has
    void check(const std::vector<std::string>& block_kinds) const;
    bool any() const { return all || !kinds.empty(); }
    Json to_json() const;     // true, false or the list
    std::string str() const;  // "off", "all", or the kinds joined by '+' ("kda+moe")
    bool operator==(const Recompute&) const = default;
};

}  // namespace tessera::model
