// tessera: train and fine-tune hybrid-attention sparse MoE language models.
// Errors end as one line on stderr and a non-zero exit status: 1 for a failed command, 2 for a
// usage error; a run stopped by SIGINT or SIGTERM exits 130 or 143 after its checkpoint. Nothing here
// prints a stack trace or aborts.
#include <omp.h>

#include <cstdio>
#include <iostream>
#include <new>

#include "apps/commands.h"
#include "apps/options.h"
#include "core/check.h"
#include "core/json.h"

namespace {
// One line, never megabytes: inputs echoed by a library or CLI11 message are cut and control characters escaped.
void print_error(const std::string& message, const char* suffix = "") {
    std::fprintf(stderr, "error: %s%s\n", tessera::excerpt(message, 1000).c_str(), suffix);
}
}  // namespace

int main(int argc, char** argv) {
    CLI::App app{
        "tessera: a training engine for hybrid-attention sparse MoE language models.\n"
        "Run 'tessera <command> --help' for a command's options."};
    app.require_subcommand(1);
    app.fallthrough();  // global options (--threads) also after the subcommand: tessera logits --threads 1 ...
    int64_t threads = 0;
    tessera::apps::add_int_option(&app, "--threads", threads, 0, 4096, "CPU threads (default: all cores)")
        ->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // given twice (before and after): the last
    app.parse_complete_callback([&] {
        if (threads > 0) omp_set_num_threads(int(threads));
    });
    tessera::apps::add_train_command(app);
    tessera::apps::add_generate_command(app);
    tessera::apps::add_logits_command(app);
    tessera::apps::add_inspect_command(app);
    tessera::apps::add_export_command(app);
    tessera::apps::add_op_command(app);
    tessera::apps::add_data_command(app);
    tessera::apps::add_launch_command(app);
    tessera::apps::add_dashboard_command(app);
    tessera::apps::add_plan_command(app);
    tessera::apps::add_calibrate_command(app);
    tessera::apps::add_simulate_command(app);
    tessera::apps::add_onboard_command(app);
    try {
        app.parse(argc, argv);
    } catch (const CLI::CallForHelp& e) {
        return app.exit(e);
    } catch (const CLI::CallForAllHelp& e) {
        return app.exit(e);
    } catch (const CLI::ParseError& e) {
        print_error(e.what(), " (see 'tessera --help')");
        return 2;
    } catch (const tessera::apps::Stopped& s) {
        if (!s.message.empty()) std::fprintf(stderr, "%s\n", s.message.c_str());
        return s.status;
    } catch (const nlohmann::json::exception& e) {
        // NOTES: a reader that asked nlohmann for a value of the wrong type (library code should check first and
        // name the file and key; this is the net under it): no "[json.exception.type_error.302]" prefix
        print_error("a JSON value has the wrong type or range: " + tessera::json_error_text(e));
        return 1;
    } catch (const std::bad_alloc&) {
        print_error("out of memory (a size in the config or the input too large for this machine?)");
        return 1;
    } catch (const std::exception& e) {
        print_error(e.what());
        return 1;
    }
    return 0;
}
