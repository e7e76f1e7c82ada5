// ndtrain: train, verify, generate, tokenize, convert, score, plan. Launch with mpirun/srun for more ranks.
#include <cstdio>
#include <map>
#include <string>

#include "apps/commands.h"
#include "core/check.h"

int main(int argc, char** argv) {
  ndt::MpiSession mpi(&argc, &argv);
  std::unique_ptr<ndt::Communicator> world = ndt::make_mpi_world();
  CLI::App app{"ndtrain: a transformer training engine where every parallel layout is the same computation"};
  app.require_subcommand(1);
  std::map<CLI::App*, ndt::app::Runner> runners;
  for (auto add : {ndt::app::add_train, ndt::app::add_verify, ndt::app::add_generate, ndt::app::add_tokenize,
                   ndt::app::add_convert, ndt::app::add_score, ndt::app::add_plan}) {
    ndt::app::Runner r = add(app);
    runners[app.get_subcommands({}).back()] = r;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // Usage errors are identical on every rank: rank 0 prints them.
    if (world->rank() == 0) return app.exit(e);
    return e.get_exit_code();
  }
  try {
    for (auto& [sub, run] : runners)
      if (sub->parsed()) return run(*world);
  } catch (const ndt::AgreedError& e) {
    // Every rank has the same message (bad config, data file or layout) and exits cleanly: no abort.
    if (world->size() == 1)
      std::fprintf(stderr, "ndtrain: error: %s\n", e.what());
    else
      std::fprintf(stderr, "ndtrain [rank %d/%d]: error: %s\n", world->rank(), world->size(), e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ndtrain: error%s: %s\n",
                 world->size() > 1 ? (" on rank " + std::to_string(world->rank())).c_str() : "", e.what());
    std::fflush(stderr);
    // Other ranks may be blocked in a collective: end the whole job rather than leave them hanging.
    if (world->size() > 1) ndt::MpiSession::abort(1);
    return 1;
  }
  return 1;
}
