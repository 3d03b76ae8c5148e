// tessera: train and fine-tune hybrid-attention sparse MoE language models.
// Errors end as one line on stderr and a non-zero exit status: 1 for a failed command, 2 for a
// usage error. Nothing here prints a stack trace or aborts.
#include <omp.h>

#include <cstdio>
#include <iostream>

#include "apps/commands.h"
#include "core/check.h"

int main(int argc, char** argv) {
    CLI::App app{
        "tessera: a training engine for hybrid-attention sparse MoE language models.\n"
        "Run 'tessera <command> --help' for a command's options."};
    app.require_subcommand(1);
    int threads = 0;
    app.add_option("--threads", threads, "CPU threads (default: all cores)")->check(CLI::NonNegativeNumber);
    app.parse_complete_callback([&] {
        if (threads > 0) omp_set_num_threads(threads);
    });
    tessera::apps::add_train_command(app);
    tessera::apps::add_generate_command(app);
    tessera::apps::add_logits_command(app);
    tessera::apps::add_inspect_command(app);
    tessera::apps::add_export_command(app);
    tessera::apps::add_op_command(app);
    tessera::apps::add_data_command(app);
    try {
        app.parse(argc, argv);
    } catch (const CLI::CallForHelp& e) {
        return app.exit(e);
    } catch (const CLI::CallForAllHelp& e) {
        return app.exit(e);
    } catch (const CLI::ParseError& e) {
        std::fprintf(stderr, "error: %s (see 'tessera --help')\n", e.what());
        return 2;
    } catch (const tessera::Error& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
    return 0;
}
