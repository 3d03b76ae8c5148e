// The 1F1B schedule (train/pipeline.h: one_f_one_b), which the pipeline step carries out and the planner's simulation
// lays out: checked against what a pipeline needs, for every stage count and micro-batch count up to 6 × 9.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "train/pipeline.h"

namespace tessera::train {
namespace {

using K = PipelineOp::Kind;

// Each stage by itself: every micro-batch loaded, run forward and backward once, in that order and in micro-batch
// order; at most w + 1 in flight (w = min(P − s − 1, M) forwards ahead), and that many reached; the last stage runs
// forward and backward at once; an input is received before its forward and an output's gradient before its backward;
// an output is sent after its forward and an input's gradient after its backward.
TEST(PipelineSchedule, EachStageRunsEveryMicroBatchOnceInOneForwardOneBackwardOrder) {
    for (int64_t P = 2; P <= 6; ++P) {
        for (int64_t M = 1; M <= 9; ++M) {
            for (int64_t s = 0; s < P; ++s) {
                SCOPED_TRACE(testing::Message() << "stage " << s << " of " << P << ", " << M << " micro-batches");
                const bool first = s == 0, last = s == P - 1;
                const std::vector<PipelineOp> ops = one_f_one_b(s, P, M);
                std::map<int64_t, size_t> loaded, forward, backward, got_input, got_grad, sent_output, sent_grad;
                int64_t in_flight = 0, most = 0;
                for (size_t at = 0; at < ops.size(); ++at) {
                    const PipelineOp& op = ops[at];
                    auto once = [&](std::map<int64_t, size_t>& seen, int64_t m) {
                        ASSERT_TRUE(m >= 0 && m < M) << "op " << at;
                        EXPECT_TRUE(seen.emplace(m, at).second) << "micro-batch " << m << " twice, op " << at;
                    };
                    switch (op.kind) {
                        case K::load:
                            once(loaded, op.micro);
                            break;
                        case K::forward:
                        case K::forward_backward:
                            EXPECT_EQ(op.kind == K::forward_backward, last);
                            EXPECT_EQ(int64_t(forward.size()), op.micro) << "forwards in micro-batch order";
                            once(forward, op.micro);
                            if (last) once(backward, op.micro);
                            most = std::max(most, ++in_flight);
                            if (last) --in_flight;
                            break;
                        case K::backward:
                            EXPECT_FALSE(last);
                            EXPECT_EQ(int64_t(backward.size()), op.micro) << "backwards in micro-batch order";
                            once(backward, op.micro);
                            --in_flight;
                            break;
                        case K::exchange:
                            EXPECT_FALSE(op.next ? last : first) << "an exchange with no one, op " << at;
                            EXPECT_TRUE(op.send >= 0 || op.receive >= 0) << "an empty exchange, op " << at;
                            if (op.send >= 0) once(op.next ? sent_output : sent_grad, op.send);
                            if (op.receive >= 0) once(op.next ? got_grad : got_input, op.receive);
                            break;
                    }
                }
                const int64_t w = std::min(P - s - 1, M);
                EXPECT_EQ(most, last ? 1 : std::min(w + 1, M));
                for (int64_t m = 0; m < M; ++m) {
                    ASSERT_TRUE(loaded.count(m) && forward.count(m) && backward.count(m)) << "micro-batch " << m;
                    EXPECT_LT(loaded[m], forward[m]);
                    EXPECT_LE(forward[m], backward[m]);
                    if (!first) {
                        ASSERT_TRUE(got_input.count(m) && sent_grad.count(m));
                        EXPECT_LT(loaded[m], got_input[m]) << "the data is read before its input arrives";
                        EXPECT_LT(got_input[m], forward[m]);
                        EXPECT_GT(sent_grad[m], backward[m]);
                    }
                    if (!last) {
                        ASSERT_TRUE(sent_output.count(m) && got_grad.count(m));
                        EXPECT_GT(sent_output[m], forward[m]);
                        EXPECT_LT(got_grad[m], backward[m]);
                    }
                }
                EXPECT_EQ(first ? 0u : size_t(M), got_input.size());
                EXPECT_EQ(last ? 0u : size_t(M), got_grad.size());
            }
        }
    }
}

// The stages together: each pair of neighbours lists the same exchanges in the same order (the k-th of stage s with
// the next is the k-th of s + 1 with the one before: what one sends the other receives), and the stages run to the
// end when every exchange waits for both sides (pairwise and blocking, as parallel::exchange is), each op taking one
// tick: no stage waits forever.
TEST(PipelineSchedule, NeighboursMatchTheirExchangesAndTheStagesNeverDeadlock) {
    for (int64_t P = 2; P <= 6; ++P) {
        for (int64_t M = 1; M <= 9; ++M) {
            SCOPED_TRACE(testing::Message() << P << " stages, " << M << " micro-batches");
            std::vector<std::vector<PipelineOp>> ops;
            for (int64_t s = 0; s < P; ++s) ops.push_back(one_f_one_b(s, P, M));
            for (int64_t s = 0; s + 1 < P; ++s) {
                std::vector<PipelineOp> down, up;  // s's with the next, s + 1's with the one before
                for (const PipelineOp& op : ops[size_t(s)])
                    if (op.kind == K::exchange && op.next) down.push_back(op);
                for (const PipelineOp& op : ops[size_t(s + 1)])
                    if (op.kind == K::exchange && !op.next) up.push_back(op);
                ASSERT_EQ(down.size(), up.size()) << "stages " << s << " and " << s + 1;
                for (size_t k = 0; k < down.size(); ++k) {
                    EXPECT_EQ(down[k].send, up[k].receive) << "exchange " << k << " of stages " << s << ", " << s + 1;
                    EXPECT_EQ(down[k].receive, up[k].send) << "exchange " << k << " of stages " << s << ", " << s + 1;
                }
            }
            std::vector<size_t> at(size_t(P), 0);
            std::vector<int64_t> clock(size_t(P), 0);
            for (bool moved = true; moved;) {
                moved = false;
                for (size_t s = 0; s < size_t(P); ++s) {
                    while (at[s] < ops[s].size()) {
                        const PipelineOp& op = ops[s][at[s]];
                        if (op.kind != K::exchange) {
                            ++clock[s], ++at[s], moved = true;
                            continue;
                        }
                        const size_t o = op.next ? s + 1 : s - 1;
                        if (at[o] >= ops[o].size()) break;
                        const PipelineOp& other = ops[o][at[o]];
                        if (other.kind != K::exchange || other.next == op.next) break;  // not (yet) at its exchange
                        clock[s] = clock[o] = std::max(clock[s], clock[o]) + 1;
                        ++at[s], ++at[o], moved = true;
                    }
                }
            }
            for (size_t s = 0; s < size_t(P); ++s) EXPECT_EQ(at[s], ops[s].size()) << "stage " << s << " stuck";
        }
    }
}

TEST(PipelineSchedule, RefusesWhatIsNoPipeline) {
    EXPECT_THROW(one_f_one_b(0, 1, 4), std::exception);
    EXPECT_THROW(one_f_one_b(2, 2, 4), std::exception);
    EXPECT_THROW(one_f_one_b(0, 2, 0), std::exception);
}

}  // namespace
}  // namespace tessera::train
