// The tessera CLI: one file per subcommand, each registering itself on the CLI11 app.
#pragma once

#include <CLI/CLI.hpp>

namespace tessera::apps {

void add_train_command(CLI::App& app);
void add_op_command(CLI::App& app);
void add_generate_command(CLI::App& app);
void add_data_command(CLI::App& app);
void add_logits_command(CLI::App& app);
void add_inspect_command(CLI::App& app);
void add_export_command(CLI::App& app);
void add_launch_command(CLI::App& app);
void add_dashboard_command(CLI::App& app);
void add_plan_command(CLI::App& app);
void add_calibrate_command(CLI::App& app);
void add_simulate_command(CLI::App& app);
void add_onboard_command(CLI::App& app);

}  // namespace tessera::apps
