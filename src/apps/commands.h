#pragma once
// Subcommands of the ndtrain CLI. Each registers its options on the app and returns the function that
// runs it (exit code). Errors are thrown as ndt::Error and reported by main on every rank.
#include <CLI/CLI.hpp>
#include <functional>

#include "dist/communicator.h"

namespace ndt::app {

using Runner = std::function<int(Communicator& world)>;

Runner add_train(CLI::App& app);
Runner add_generate(CLI::App& app);
Runner add_tokenize(CLI::App& app);
Runner add_verify(CLI::App& app);
Runner add_convert(CLI::App& app);
Runner add_score(CLI::App& app);
Runner add_plan(CLI::App& app);

}  // namespace ndt::app
