// A gate the host opens: lets a test hold a stream at a known point (submit gate.pass(), check that later
// work has not run, then gate.open()).
#pragma once

#include <future>

namespace loom::testing {

struct Gate {
    std::promise<void>       promise;
    std::shared_future<void> future = promise.get_future().share();
    void open() { promise.set_value(); }
    void pass() const { future.wait(); }
};

}  // namespace loom::testing
