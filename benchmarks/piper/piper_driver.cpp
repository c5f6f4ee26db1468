// A command-line entry to Piper's planner (msr-fiddle/piper, NeurIPS'21) for benchmarks/bench_piper.py.
//
// Piper's algo.cpp runs the paper's experiments from its main(); this file renames that main away and runs
// one instance instead: it reads the input JSON named on the command line, runs Piper's dynamic program and
// writes one JSON object to stdout: {"tps": Piper's objective (seconds per microbatch in the steady state),
// "seconds": CPU seconds of the search, "stages": Piper's stages with the input's node ids}. An infeasible
// instance gives {"tps": null, ...}. Nothing of Piper's code is copied here; build with
//
//     g++ -O2 -std=c++17 -I PIPER_SRC -o piper benchmarks/piper/piper_driver.cpp
//
// where PIPER_SRC is a checkout of github.com/msr-fiddle/piper (algo.cpp and nlohmann/json.hpp).
#define main piper_paper_experiments
#include "algo.cpp"
#undef main

#include <ctime>

int main(int argc, char **argv) {
    if (argc != 2) {
        cerr << "usage: " << argv[0] << " INPUT.json" << endl;
        return 2;
    }
    json input;
    ifstream file(argv[1]);
    file >> input;
    Instance instance = input.get<Instance>();
    const clock_t start = clock();
    Graph graph(instance);
    Result result = graph.runDP();
    const double seconds = (clock() - start) * 1.0 / CLOCKS_PER_SEC;
    json out;
    out["seconds"] = seconds;
    if (result.stages.empty()) {
        out["tps"] = nullptr;
        out["stages"] = json::array();
    } else {
        out["tps"] = graph.getTPSForResult(result);  // before renumbering: it checks Piper's own numbering
        graph.renumberResultBack(result);
        out["stages"] = result.stages;
    }
    cout << out.dump() << endl;
    return 0;
}
