from stages.export import command

command()
